"""Manual: the worker the request names."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.placement.policies.base import C, Hints, Policy
from gateway.placement.policies.round_robin import RoundRobin


class Manual(Policy):
    """The worker the request names (`x-target-worker`); declines if it is not available.

    Without a name it rotates like round robin.
    """

    name = "manual"

    def __init__(self) -> None:
        self.fallback = RoundRobin()

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        if hints.target_worker is None:
            return self.fallback.pick(candidates, hints)
        return next((c for c in candidates if c.id == hints.target_worker), None)
