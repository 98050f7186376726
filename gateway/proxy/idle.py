"""Stream idle timeout: a stream on which no message moved for a while is ended.

A client that stops reading (so writes stop completing) and a worker that stops sending
both leave a stream that holds a slot, a worker's attention and memory while nothing
happens. The watchdog costs nothing per message: a timer looks at the call's message
count every half period, so an idle stream ends between 1 and 1.5 periods after its last
message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gateway.record import CallRecord


class StreamIdle(Exception):
    """No message moved on the stream for the configured time."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"Stream idle for {idle_s:g} s: no message moved either way")


@contextlib.asynccontextmanager
async def idle_limit(record: CallRecord, idle_s: float) -> AsyncIterator[None]:
    """Run the block under the watchdog; raises `StreamIdle` if it fires (0: off)."""
    if idle_s <= 0:
        yield
        return
    loop = asyncio.get_running_loop()
    seen = record.messages
    timer: asyncio.TimerHandle | None = None
    try:
        async with asyncio.timeout(idle_s) as watch:

            def look() -> None:
                nonlocal seen, timer
                if record.messages != seen:
                    seen = record.messages
                    watch.reschedule(loop.time() + idle_s)
                timer = loop.call_later(idle_s / 2, look)

            timer = loop.call_later(idle_s / 2, look)
            try:
                yield
            finally:
                timer.cancel()
    except TimeoutError:
        raise StreamIdle(idle_s) from None
