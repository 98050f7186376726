"""What a placement policy is: it picks one worker from the available candidates of one
leg, and the small helpers the built-in policies share.

A policy sees only a snapshot (the candidates, sorted by id, and the request's hints)
and returns a candidate or None (declined). Policies keep at most a tiny rotation
state, so every decision is a pure function of (snapshot, hints, state) and easy to test.
A plugin policy subclasses `Policy` the same way (see `registry`).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, Self, TypeVar

from gateway.core.slo import Slo
from gateway.observability.record import PlacedOn
from gateway.upstream.cluster import PolicyContext

if TYPE_CHECKING:
    from gateway.kv.prefix import Prefix

__all__ = [
    "C",
    "Candidate",
    "Choice",
    "Hints",
    "Policy",
    "PolicyContext",
    "Unattainable",
    "rendezvous_pick",
    "rotate_after",
]


@dataclass(frozen=True, slots=True)
class Unattainable:
    """A policy's answer for a sheddable call that no candidate is predicted to serve
    within its latency objectives: the best predictions it had against them."""

    slo: Slo
    ttft_s: float | None  # the best predicted time to first token (the leg's, if it says)
    tpot_s: float | None  # the best predicted time per output token (if it could say)

    def late_s(self) -> float:
        """How far the best prediction is past the objectives (when to try again)."""
        late = 0.0
        if self.slo.ttft_s is not None and self.ttft_s is not None:
            late = max(late, self.ttft_s - self.slo.ttft_s)
        if self.slo.tpot_s is not None and self.tpot_s is not None:
            late = max(late, self.tpot_s - self.slo.tpot_s)
        return late


class Candidate(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def inflight(self) -> int: ...


C = TypeVar("C", bound=Candidate)
W = TypeVar("W")
# Tie orders kept (a prompt's anchor and its candidates): ~0.4 KB each at 16 candidates,
# ~4 KB at 256 (at most ~4 MB); a client choosing prompts only churns them. A fleet's hot
# prompts (a tenant's system prompt) are far fewer.
RENDEZVOUS_ORDERS = 1024


@dataclass(frozen=True, slots=True)
class Hints:
    """What the request says about where it wants to go."""

    routing_key: str | None = None
    target_worker: str | None = None
    prefix: Prefix | None = None  # the prompt, for cache-aware placement
    slo: Slo | None = None  # its latency objectives, if it states any


@dataclass(frozen=True, slots=True)
class Choice(Generic[W]):
    """A policy's answer for one leg: the worker, and what the policy learned on the way
    (a cache-aware policy: the data-parallel rank holding the prompt, the tokens it
    expects cached there). A value: policies never write into the hints instead."""

    worker: W
    rank: int | None = None  # the data-parallel rank to run on (None: the engine's choice)
    expected_cached: int | None = None  # prompt tokens the index expects cached there
    placed_on: PlacedOn | None = None  # the worker as it saw it (latency learning)


def rotate_after(ids: Sequence[str], last: str | None) -> int:
    """Index of the first id after `last` in sorted order (wrapping).

    Keyed by id rather than a counter, so the rotation stays fair when workers
    come and go: a new or removed worker shifts nobody else's turn.
    """
    if last is None or not ids:
        return 0
    return bisect.bisect_right(ids, last) % len(ids)


def rendezvous_weight(key: str, worker_id: str) -> bytes:
    """Highest-random-weight hashing's weight of a worker for a key: the same in every
    process and replica."""
    return hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest()


def rendezvous_pick(candidates: Sequence[C], key: str) -> C:
    """Highest-random-weight hashing: a key keeps its worker while that worker stays."""
    return max(candidates, key=lambda c: rendezvous_weight(key, c.id))


def rendezvous_order(ids: Sequence[str], key: str) -> Sequence[int]:
    """The candidates' indices in `rendezvous_pick`'s order for `key`, best first (so
    gateways that see the same prompt break ties alike, and different prompts spread)."""
    return _rendezvous_order(tuple(ids), key)


@functools.lru_cache(maxsize=RENDEZVOUS_ORDERS)
def _rendezvous_order(ids: tuple[str, ...], key: str) -> tuple[int, ...]:
    """A hot prompt's candidates come again and again: a hash per candidate and a sort
    (~12 us at 16 candidates, measured) kept for the most recent ones."""
    ranked = sorted(range(len(ids)), key=lambda i: rendezvous_weight(key, ids[i]), reverse=True)
    return tuple(ranked)


class Policy:
    """One cluster's policy (one instance per cluster, so legs never share a rotation).
    A subclass sets `name`, and overrides `pick` (or `choose`, to say more than the
    worker) and, if it needs the context, `build`."""

    name = "base"

    @classmethod
    def build(cls, context: PolicyContext) -> Self:
        """A new instance for one cluster; the default takes nothing from the context."""
        return cls()

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        raise NotImplementedError

    def choose(self, candidates: Sequence[C], hints: Hints) -> Choice[C] | Unattainable | None:
        """The pick as a `Choice` (a policy that learns more says so by overriding this);
        `Unattainable` for a sheddable call it predicts none can serve in time."""
        picked = self.pick(candidates, hints)
        return None if picked is None else Choice(picked)
