"""Reading a call's request message: bounded in time, and in how many are read at once.

grpc core buffers a request message until it is complete, up to `max_message_bytes`, but
only while the application reads it: a stream nobody reads is held back by HTTP/2 flow
control after its first stream window. So the front reads requests itself (every method
is served as request-streaming, which is the same on the wire) and lets at most
`max_request_reads` reads run at once, `max_request_reads_per_peer` per caller: what
partially sent messages can make the gateway hold is that many times the message limit,
whatever the number of streams. A stream waits its turn in order, and the whole read,
wait included, must end within `request_read_timeout_s` of the stream opening, so a
stream that sends its headers, or half a message, and stops is ended.
"""

from __future__ import annotations

import asyncio
from collections import deque

from grpc import aio

from gateway.proxy.status import abort_invalid


class ReadGate:
    """Turns to read a request: at most `total` at once and `per_caller` for one caller;
    callers waiting for a turn are served in rotation, each caller's streams in order."""

    __slots__ = ("_busy", "_queues", "_ready", "_ready_set", "per_caller", "reading", "total")

    def __init__(self, total: int, per_caller: int) -> None:
        self.total, self.per_caller = total, per_caller
        self.reading = 0
        self._busy: dict[str, int] = {}  # caller -> reads running
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}  # caller -> waiting
        self._ready: deque[str] = deque()  # callers with waiters, under their own bound
        self._ready_set: set[str] = set()

    def _take(self, caller: str) -> None:
        self.reading += 1
        self._busy[caller] = self._busy.get(caller, 0) + 1

    def _give(self, caller: str) -> None:
        self.reading -= 1
        left = self._busy[caller] - 1
        if left:
            self._busy[caller] = left
        else:
            del self._busy[caller]
        self._mark_ready(caller)
        self._wake()

    def _mark_ready(self, caller: str) -> None:
        if caller in self._queues and caller not in self._ready_set:
            self._ready.append(caller)
            self._ready_set.add(caller)

    def _wake(self) -> None:
        """Hand free turns to waiting callers in rotation (a caller at its own bound
        waits for its own reads, never blocking the callers behind it)."""
        while self.reading < self.total and self._ready:
            caller = self._ready.popleft()
            self._ready_set.discard(caller)
            queue = self._queues[caller]
            while queue and queue[0].done():  # cancelled while waiting
                queue.popleft()
            if not queue:
                del self._queues[caller]
                continue
            if self._busy.get(caller, 0) >= self.per_caller:
                continue  # back in rotation when one of its reads ends
            self._take(caller)
            queue.popleft().set_result(None)
            if queue:
                self._mark_ready(caller)
            else:
                del self._queues[caller]

    def enter(self, caller: str) -> bool:
        """Take a turn now if one is free for `caller` (no one of its own waiting first)."""
        if (
            caller not in self._queues
            and self.reading < self.total
            and self._busy.get(caller, 0) < self.per_caller
        ):
            self._take(caller)
            return True
        return False

    async def wait(self, caller: str) -> None:
        """Wait in `caller`'s line for a turn (after `enter` said no)."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(caller, deque()).append(turn)
        self._mark_ready(caller)
        self._wake()
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._give(caller)  # handed a turn in the instant it was cancelled
            else:
                turn.cancel()  # dropped from its queue when the rotation reaches it
            raise

    def leave(self, caller: str) -> None:
        """A turn `enter` or `wait` gave ends."""
        self._give(caller)

    @property
    def waiting(self) -> int:
        return sum(1 for queue in self._queues.values() for turn in queue if not turn.done())


NO_REQUEST = "The call carried no request message"


class ReadTimeout(Exception):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"No complete request message within {timeout_s:g} s of the stream opening "
            "(limits.request_read_timeout_s)"
        )


async def read_request(context: aio.ServicerContext, gate: ReadGate, caller: str) -> bytes:
    """The call's one request message, read in the caller's turn (the call's deadline
    bounds it); answers INVALID_ARGUMENT when there is none."""
    if not gate.enter(caller):
        await gate.wait(caller)
    try:
        message = await context.read()
    finally:
        gate.leave(caller)
    if message is aio.EOF or message is None:
        await abort_invalid(context, NO_REQUEST)
    return message  # type: ignore[no-any-return]
