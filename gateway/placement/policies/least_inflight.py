"""Least in flight: the candidate with the fewest requests the gateway has on it."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.placement.policies.base import C, Hints, Policy, rotate_after


class LeastInflight(Policy):
    """Fewest in flight; ties rotate so an idle fleet is still spread evenly."""

    name = "least_inflight"

    def __init__(self) -> None:
        self.last: str | None = None

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        if not candidates:
            return None
        start = rotate_after([c.id for c in candidates], self.last)
        ordered = list(candidates[start:]) + list(candidates[:start])
        chosen = min(ordered, key=lambda c: c.inflight)
        self.last = chosen.id
        return chosen
