"""Load-balancing policies: pick one worker from the available candidates of one leg.

A policy sees only a snapshot (the candidates, sorted by id, and the request's hints)
and returns a candidate or None (declined). Policies keep at most a tiny rotation
state, so every decision is a pure function of (snapshot, hints, state) and easy to test.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from gateway.kv.prefix import Prefix


class Candidate(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def inflight(self) -> int: ...


C = TypeVar("C", bound=Candidate)
W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class Hints:
    """What the request says about where it wants to go."""

    routing_key: str | None = None
    target_worker: str | None = None
    prefix: Prefix | None = None  # the prompt, for cache-aware placement


@dataclass(frozen=True, slots=True)
class Choice(Generic[W]):
    """A policy's answer for one leg: the worker, and what the policy learned on the way
    (a cache-aware policy: the data-parallel rank holding the prompt, the tokens it
    expects cached there). A value: policies never write into the hints instead."""

    worker: W
    rank: int | None = None  # the data-parallel rank to run on (None: the engine's choice)
    expected_cached: int | None = None  # prompt tokens the index expects cached there


def rotate_after(ids: Sequence[str], last: str | None) -> int:
    """Index of the first id after `last` in sorted order (wrapping).

    Keyed by id rather than a counter, so the rotation stays fair when workers
    come and go: a new or removed worker shifts nobody else's turn.
    """
    if last is None or not ids:
        return 0
    return bisect.bisect_right(ids, last) % len(ids)


def rendezvous_pick(candidates: Sequence[C], key: str) -> C:
    """Highest-random-weight hashing: a key keeps its worker while that worker stays."""

    def weight(c: C) -> bytes:
        return hashlib.blake2b(f"{key}\0{c.id}".encode(), digest_size=8).digest()

    return max(candidates, key=weight)


class Policy:
    name = "base"

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        raise NotImplementedError

    def choose(self, candidates: Sequence[C], hints: Hints) -> Choice[C] | None:
        """The pick as a `Choice` (a policy that learns more says so by overriding this)."""
        picked = self.pick(candidates, hints)
        return None if picked is None else Choice(picked)


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


class Random(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        return self.rng.choice(candidates) if candidates else None


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


POLICY_TYPES: dict[str, Callable[[], Policy]] = {
    cls.name: cls for cls in (RoundRobin, Random, PowerOfTwo, LeastInflight, ConsistentHash, Manual)
}


def make_policy(name: str) -> Policy:
    return POLICY_TYPES[name]()
