"""Admission: the gateway's own bound on calls served at once, over every protocol, and
each caller's share of it.

Past either bound a call is refused at once instead of queueing: a client cannot make
the gateway hold more work than it was sized for, and one caller (a principal: API key,
client certificate, else peer address) cannot take the slots every other caller needs.
A call holds its slot from the moment its stream opens, before its request arrives, so
streams that never send one count too.
"""

from __future__ import annotations

from enum import Enum


class Refusal(Enum):
    GATEWAY_FULL = "gateway_full"
    CALLER_FULL = "caller_full"


class Admission:
    __slots__ = ("_held", "active", "limit", "per_caller")

    def __init__(self, limit: int, per_caller: int | None = None) -> None:
        self.limit = limit
        self.per_caller = limit if per_caller is None else per_caller
        self.active = 0
        self._held: dict[str, int] = {}  # caller -> calls in flight (absent: none)

    def enter(self, caller: str) -> Refusal | None:
        """Take a slot for `caller`; why not, when a bound is reached."""
        if self.active >= self.limit:
            return Refusal.GATEWAY_FULL
        held = self._held.get(caller, 0)
        if held >= self.per_caller:
            return Refusal.CALLER_FULL
        self._held[caller] = held + 1
        self.active += 1
        return None

    def leave(self, caller: str) -> None:
        self.active -= 1
        held = self._held[caller] - 1
        if held:
            self._held[caller] = held
        else:
            del self._held[caller]

    def held(self, caller: str) -> int:
        return self._held.get(caller, 0)

    @property
    def callers(self) -> int:
        return len(self._held)
