"""Admission: the gateway's own bound on calls served at once, over every protocol.

Past it a call is refused at once (GATEWAY_OVERLOADED) instead of queueing: a client
cannot make the gateway hold more work than it was sized for.
"""

from __future__ import annotations


class Admission:
    __slots__ = ("active", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def enter(self) -> bool:
        """Take a slot; False when every slot is taken."""
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1
