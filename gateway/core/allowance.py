"""`Allowance`: a process-wide bound on what its calls hold at once."""

from __future__ import annotations


class Allowance:
    """Room shared by one process's calls (bytes kept, token ids kept): each takes room
    before it keeps something and gives it back when it lets go, so the total never
    passes `limit` whatever the clients or workers send."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, amount: int) -> bool:
        """Room for `amount` more, taken; False (nothing taken) past the limit."""
        if self.held + amount > self.limit:
            return False
        self.held += amount
        return True

    def give(self, amount: int) -> None:
        self.held -= amount
