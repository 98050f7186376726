"""Cache-aware placement: send a prompt where most of it is already cached, within a
balance guard so affinity never piles requests on one worker.

cost(worker) = uncached prompt tokens x prefill_cost_per_token + load
load(worker) = the gateway's own in-flight count on it, plus the requests the worker's last
fresh report (KV event stream load record, or GetLoads) showed beyond the gateway's own at
that time: other clients' load. A report is a snapshot; the own count is always current.

Balance guard, two rules, so affinity never piles requests on one worker:
- now: only candidates whose load is at most balance_ratio x the lowest load +
  balance_slack compete;
- over time: only candidates whose share of recent placements (decaying with
  `share_window_s`; kept by the index, and with a shared store every gateway's) is at
  most balance_ratio x the mean share + 1 compete. Accurate cache
  knowledge makes affinity strong (a tenant's prompt lives on one or two workers); this
  keeps the busiest worker within balance_ratio of the mean over the window.
The lowest cost among those wins, ties to the lower load, then to the candidates'
rendezvous order for the prompt's first tokens (every gateway, replica or process, breaks
a tie for the same prompt alike, so replicas started in step do not herd, and a new
prefix goes to one worker whichever gateway places it), else to rotation.

Loop time: the prompt is hashed before placement (`Prefix.prepare`, in a thread for long
prompts); a placement then costs a lookup per cached block of the prompt (a dict get and
an AND, in C) plus remembering at most ASSUME_BLOCKS blocks where it went.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self, cast

from gateway.config import KvConfig
from gateway.kv.index import KvIndex
from gateway.observability.record import PlacedOn
from gateway.placement.policies.base import (
    C,
    Choice,
    Hints,
    Policy,
    PolicyContext,
    Unattainable,
    rendezvous_order,
    rotate_after,
)
from gateway.upstream.worker import Worker

if TYPE_CHECKING:
    from gateway.kv.prefix import Prefix


def load_of(worker: Worker, now: float, stale_after_s: float) -> float:
    """The gateway's own in-flight count (always current), plus what the worker's last
    fresh report showed beyond it (other clients')."""
    report = worker.load
    if report is None or now - report.at > stale_after_s:
        return float(worker.inflight)
    return float(worker.inflight + report.others())


def cheapest(
    loads: Sequence[float],
    uncached: Sequence[int],
    settings: KvConfig,
    order: Sequence[int],
    shares: Sequence[float] | None = None,
) -> int:
    """Index of the candidate to pick (pure: loads, uncached tokens, recent placement
    shares, tie-break order)."""
    floor = min(loads)
    bound = floor * settings.balance_ratio + settings.balance_slack
    share_bound = sum(shares) / len(shares) * settings.balance_ratio + 1 if shares else float("inf")
    best = None
    fallback = None
    for i in order:
        if loads[i] > bound:
            continue
        if fallback is None or shares is None or shares[i] < shares[fallback]:
            fallback = i  # if every candidate is over its share: the least placed one
        if shares is not None and shares[i] > share_bound:
            continue
        key = (uncached[i] * settings.prefill_cost_per_token + loads[i], loads[i])
        if best is None or key < best[0]:
            best = (key, i)
    if best is None:
        assert fallback is not None  # the least loaded candidate is always within bound
        return fallback
    return best[1]


@dataclass(frozen=True, slots=True)
class View:
    """One placement's candidates as cache-aware placement weighs them."""

    workers: Sequence[Worker]
    prefix: Prefix | None
    now: float
    matched: dict[str, tuple[int, int]]  # worker -> (tokens cached, rank)
    loads: list[float]
    uncached: list[int]
    order: Sequence[int]  # tie-break order, best first
    shares: list[float]
    backlogs: list[int]  # uncached tokens placed there, not yet at their first message


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, index: KvIndex, settings: KvConfig, stale_after_s: float) -> None:
        self.index = index
        self.settings = settings
        self.stale_after_s = stale_after_s
        self.last: str | None = None
        self._seen: list[str] = []  # the candidates of the last placement

    @classmethod
    def build(cls, context: PolicyContext) -> Self:
        return cls(context.kv_index, context.kv, context.stale_after_s)

    def block_sizes(self) -> set[int]:
        """The block sizes a placement will hash the prompt for: those of the last
        candidates' slots (every slot's before the first placement)."""
        return self.index.block_sizes(self._seen or None)

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        chosen = self.choose(candidates, hints)
        return chosen.worker if isinstance(chosen, Choice) else None

    def choose(self, candidates: Sequence[C], hints: Hints) -> Choice[C] | Unattainable | None:
        if not candidates:
            return None
        view = self.view(candidates, hints)
        return self.commit(view, self.best(view))

    def view(self, candidates: Sequence[C], hints: Hints) -> View:
        """What the placement weighs, per candidate: its load, its uncached prompt
        tokens, its recent share, and the order ties go in."""
        workers = cast("Sequence[Worker]", candidates)  # placement's candidates are workers
        now = time.monotonic()
        prefix = hints.prefix
        ids = [w.id for w in workers]
        self._seen = ids
        matched: dict[str, tuple[int, int]] = {}  # worker -> (tokens, rank)
        if prefix is not None:
            for (worker_id, rank), tokens in self.index.matched_tokens(prefix, ids, now).items():
                if tokens > matched.get(worker_id, (-1, 0))[0]:
                    matched[worker_id] = (tokens, rank)
        total = len(prefix) if prefix is not None else 0
        loads = [load_of(w, now, self.stale_after_s) for w in workers]
        uncached = [total - matched.get(w.id, (0, 0))[0] for w in workers]
        anchor = prefix.anchor() if prefix is not None else None
        if anchor is not None:  # every gateway breaks a tie for this prompt alike
            order = rendezvous_order(ids, anchor)
        else:
            start = rotate_after(ids, self.last)
            order = [*range(start, len(ids)), *range(start)]
        shares = [self.index.share(i, now) for i in ids]  # every gateway's, with a store
        backlogs = [w.prefill_backlog for w in workers]
        return View(workers, prefix, now, matched, loads, uncached, order, shares, backlogs)

    def best(self, view: View) -> int:
        """The index of the candidate to place on: the cheapest within the guard."""
        return cheapest(view.loads, view.uncached, self.settings, view.order, view.shares)

    def commit(
        self, view: View, pick: int, stored: int | None = None, predicted_s: float | None = None
    ) -> Choice[C]:
        """The placement made: remembered by the index (assumed cached there, counted in
        the shares), and what the call should know of it. `stored`: what the chosen
        worker is seen to store of the prompt, if the caller has found it already;
        `predicted_s`: its predicted time to first message, if the caller predicted it."""
        chosen = view.workers[pick]
        now, prefix, matched = view.now, view.prefix, view.matched
        self.last = chosen.id
        self.index.placed(chosen.id, now)
        seen = PlacedOn(view.loads[pick], view.backlogs[pick], predicted_s)
        if prefix is None:
            return Choice(cast("C", chosen), placed_on=seen)
        hit = matched.get(chosen.id)
        # What the worker holds of it before this placement adds it.
        if stored is not None:
            expected = stored
        else:
            expected = self.index.stored_tokens(prefix, (chosen.id, hit[1]), hit[0]) if hit else 0
        kv_tokens = chosen.load.kv_tokens if chosen.load is not None else None
        slot = (chosen.id, hit[1] if hit else 0)
        self.index.assume(slot, prefix, now, kv_tokens, chosen.block_size, expected)
        # A data-parallel worker: name the rank whose cache holds the prompt, rather than
        # leave it to the engine's own balancing (a hit on a rank past 0 says the worker
        # has ranks, even before its other ranks sent their first batch: live only).
        on_rank = None
        if hit is not None and (hit[1] > 0 or self.index.ranks(chosen.id) > 1):
            on_rank = hit[1]
        return Choice(cast("C", chosen), on_rank, expected, seen)
