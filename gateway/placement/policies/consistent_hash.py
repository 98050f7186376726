"""Consistent hash: the same routing key keeps its worker."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.placement.policies.base import C, Hints, Policy, rendezvous_pick
from gateway.placement.policies.round_robin import RoundRobin


class ConsistentHash(Policy):
    """Same routing key, same worker (rendezvous hashing); no key falls back to round robin."""

    name = "consistent_hash"

    def __init__(self) -> None:
        self.fallback = RoundRobin()

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        if not candidates:
            return None
        if hints.routing_key is None:
            return self.fallback.pick(candidates, hints)
        return rendezvous_pick(candidates, hints.routing_key)
