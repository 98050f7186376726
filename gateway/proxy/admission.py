"""Admission: the gateway's own bound on calls served at once, over every protocol, and
each caller's share of it.

Past either bound a call is refused at once instead of queueing: a client cannot make
the gateway hold more work than it was sized for, and one caller (a principal: API key,
client certificate, else peer address) cannot take the slots every other caller needs.
A call holds its slot from the moment its stream opens, before its request arrives, so
streams that never send one count too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum


class Refusal(Enum):
    GATEWAY_FULL = "gateway_full"
    CALLER_FULL = "caller_full"


class Admission:
    __slots__ = ("_area", "_clock", "_held", "_since", "active", "limit", "per_caller")

    def __init__(
        self,
        limit: int,
        per_caller: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.per_caller = limit if per_caller is None else per_caller
        self.active = 0
        self._held: dict[str, int] = {}  # caller -> calls in flight (absent: none)
        self._clock = clock
        self._area = 0.0  # call-seconds in flight up to `_since` (see `busy`)
        self._since = clock()

    def configure(self, limit: int, per_caller: int | None = None) -> None:
        """A reload: the bounds from the next call on (calls in flight past a lowered
        bound finish; no new one enters until they are under it)."""
        self.limit = limit
        self.per_caller = limit if per_caller is None else per_caller

    def enter(self, caller: str) -> Refusal | None:
        """Take a slot for `caller`; why not, when a bound is reached."""
        if self.active >= self.limit:
            return Refusal.GATEWAY_FULL
        held = self._held.get(caller, 0)
        if held >= self.per_caller:
            return Refusal.CALLER_FULL
        self._held[caller] = held + 1
        self._tally()
        self.active += 1
        return None

    def leave(self, caller: str) -> None:
        self._tally()
        self.active -= 1
        held = self._held[caller] - 1
        if held:
            self._held[caller] = held
        else:
            del self._held[caller]

    def _tally(self) -> None:
        now = self._clock()
        self._area += self.active * (now - self._since)
        self._since = now

    def busy(self) -> float:
        """Calls in flight integrated over time, in call-seconds, up to now: its growth
        over an interval divided by the interval is the mean number in flight then (the
        load report's utilization), however briefly each call held its slot."""
        return self._area + self.active * (self._clock() - self._since)

    def held(self, caller: str) -> int:
        return self._held.get(caller, 0)

    @property
    def callers(self) -> int:
        return len(self._held)
