"""Random: any candidate, uniformly (the module is not `random`, which it uses)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.placement.policies.base import C, Hints, Policy


class Random(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        return self.rng.choice(candidates) if candidates else None
