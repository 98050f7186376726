"""gRPC messages cut out of a response body as Envoy hands it over, piece by piece.

A body is length-prefixed messages (a compressed flag, a 4-byte length, the message), and
Envoy's pieces split them anywhere. Only a call's usage is read from them, and a worker
controls every byte: a message is kept only up to `max_message` bytes, and only while
the shared `Budget` has room; a longer one is stepped over as it passes, its bytes never
held. Bytes that are no gRPC framing end the reading for good."""

from __future__ import annotations

from gateway.core.allowance import Allowance
from gateway.picker.wire import FRAME_HEADER

COMPRESSED = 1  # the flag of a message the worker compressed: not read here


class Budget(Allowance):
    """The bytes every call's reader may hold at once, in one process."""

    __slots__ = ()


class Frames:
    """One response body's messages as its pieces come (`feed`). Each message completed
    is given in order: its bytes, or None for one stepped over (past `max_message`, past
    the budget, or compressed). What it holds (the message being read and the last one
    given: the call may still keep it) counts against the budget until `close`."""

    __slots__ = ("_budget", "_head", "_kept", "_left", "_max", "_parts", "_reading", "broken")

    def __init__(self, max_message: int, budget: Budget) -> None:
        self._max = max_message
        self._budget = budget
        self._head = b""  # a prefix cut short by the piece's end
        self._left = 0  # bytes of the current message still to come
        self._parts: list[bytes] | None = None  # the current message's bytes, if kept
        self._reading = 0  # what the current message takes of the budget
        self._kept = 0  # what the last message given takes of it
        self.broken = False  # bytes that are no gRPC framing: nothing more is read

    def feed(self, data: bytes) -> list[bytes | None]:
        """The messages this piece completes, in order."""
        done: list[bytes | None] = []
        view = memoryview(data)
        at, size = 0, len(data)
        while at < size and not self.broken:
            if self._left:
                take = min(self._left, size - at)
                if self._parts is not None:
                    self._parts.append(bytes(view[at : at + take]))
                at += take
                self._left -= take
                if not self._left:
                    done.append(self._complete())
                continue
            need = FRAME_HEADER - len(self._head)
            self._head += bytes(view[at : at + need])
            at += min(need, size - at)
            if len(self._head) < FRAME_HEADER:
                continue
            if not self._begin():
                done.append(None)  # what follows is unknown: the last message read is not
            elif not self._left:
                done.append(self._complete())  # an empty message: nothing more of it comes
        return done

    def _begin(self) -> bool:
        """A prefix read whole: the message it announces is kept or stepped over. False
        for no gRPC prefix (nothing more is read)."""
        head, self._head = self._head, b""
        flag, length = head[0], int.from_bytes(head[1:FRAME_HEADER], "big")
        if flag > COMPRESSED:
            self.broken = True
            self.close()
            return False
        keep = flag != COMPRESSED and length <= self._max and self._budget.take(length)
        self._parts = [] if keep else None
        self._reading = length if keep else 0
        self._left = length
        return True

    def _complete(self) -> bytes | None:
        """The current message, whole: given, and what the one before it held goes back."""
        parts, self._parts = self._parts, None
        self._budget.give(self._kept)
        self._kept, self._reading = self._reading, 0
        if parts is None:
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def partial(self) -> bool:
        """A message is cut short where the body ends."""
        return bool(self._left or self._head)

    @property
    def held(self) -> int:
        """The budget's bytes this reader takes now."""
        return self._kept + self._reading

    def close(self) -> None:
        """The body is over (or its reading): everything held goes back to the budget."""
        self._budget.give(self._kept + self._reading)
        self._kept = self._reading = 0
        self._parts = None
        self._left = 0
