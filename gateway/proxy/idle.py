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

from gateway.observability.record import CallRecord


class StreamIdle(Exception):
    """No message moved on the stream for the configured time."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"Stream idle for {idle_s:g} s: no message moved either way")


class _Watch:
    """Every half period, moves the deadline on if a message moved since the last look.
    A class, not a closure: a function that reschedules itself holds itself in a cycle,
    with the call's record and task, until the garbage collector's rare full pass (2,000
    ended calls' worth of memory stayed that way)."""

    __slots__ = ("_deadline", "_idle_s", "_loop", "_record", "_seen", "_timer")

    def __init__(self, record: CallRecord, idle_s: float, deadline: asyncio.Timeout) -> None:
        self._record, self._idle_s, self._deadline = record, idle_s, deadline
        self._loop = asyncio.get_running_loop()
        self._seen = record.messages
        self._timer = self._loop.call_later(idle_s / 2, self._look)

    def _look(self) -> None:
        if self._record.messages != self._seen:
            self._seen = self._record.messages
            self._deadline.reschedule(self._loop.time() + self._idle_s)
        self._timer = self._loop.call_later(self._idle_s / 2, self._look)

    def stop(self) -> None:
        self._timer.cancel()  # a cancelled handle lets go of its callback, and of this


@contextlib.asynccontextmanager
async def idle_limit(record: CallRecord, idle_s: float) -> AsyncIterator[None]:
    """Run the block under the watchdog; raises `StreamIdle` if it fires (0: off)."""
    if idle_s <= 0:
        yield
        return
    try:
        async with asyncio.timeout(idle_s) as deadline:
            watch = _Watch(record, idle_s, deadline)
            try:
                yield
            finally:
                watch.stop()
    except TimeoutError:
        raise StreamIdle(idle_s) from None
