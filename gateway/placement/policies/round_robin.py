"""Round robin: each candidate in turn, by id."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.placement.policies.base import C, Hints, Policy, rotate_after


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.last: str | None = None

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        if not candidates:
            return None
        chosen = candidates[rotate_after([c.id for c in candidates], self.last)]
        self.last = chosen.id
        return chosen
