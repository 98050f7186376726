"""Power of two choices: two random candidates, the less busy one."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.placement.policies.base import C, Hints, Policy


class PowerOfTwo(Policy):
    """Two random candidates, the one with fewer requests in flight."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        a, b = self.rng.sample(list(candidates), 2)
        return a if a.inflight <= b.inflight else b
