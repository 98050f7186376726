"""Cache-aware placement: send a prompt where most of it is already cached, within a
balance guard so affinity never piles requests on one worker.

cost(worker) = uncached prompt tokens x prefill_cost_per_token + load
load(worker) = running + waiting as the worker last reported them (KV event stream load
record or GetLoads, while fresh), never less than the gateway's own in-flight count.

Only candidates whose load is at most balance_ratio x the lowest load + balance_slack
compete; the lowest cost wins, ties to the lower load, then to rotation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

from gateway.config import KvConfig
from gateway.fleet.worker import Worker
from gateway.kv.index import KvIndex
from gateway.placement.policies import C, Hints, Policy, rotate_after


def load_of(worker: Worker, now: float, stale_after_s: float) -> float:
    report = worker.load
    if report is None or now - report.at > stale_after_s:
        return float(worker.inflight)
    return float(max(worker.inflight, report.running + report.waiting))


def cheapest(
    loads: Sequence[float],
    uncached: Sequence[int],
    settings: KvConfig,
    order: Sequence[int],
) -> int:
    """Index of the candidate to pick (pure: loads, uncached tokens, tie-break order)."""
    floor = min(loads)
    bound = floor * settings.balance_ratio + settings.balance_slack
    best = None
    for i in order:
        if loads[i] > bound:
            continue
        key = (uncached[i] * settings.prefill_cost_per_token + loads[i], loads[i])
        if best is None or key < best[0]:
            best = (key, i)
    assert best is not None  # the least loaded candidate is always within the bound
    return best[1]


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, index: KvIndex, settings: KvConfig, stale_after_s: float) -> None:
        self.index = index
        self.settings = settings
        self.stale_after_s = stale_after_s
        self.last: str | None = None

    def pick(self, candidates: Sequence[C], hints: Hints) -> C | None:
        if not candidates:
            return None
        workers = cast("Sequence[Worker]", candidates)  # placement's candidates are workers
        now = time.monotonic()
        prefix = hints.prefix
        ids = [w.id for w in workers]
        matched: dict[str, tuple[int, int]] = {}  # worker -> (tokens, rank)
        if prefix is not None:
            for (worker_id, rank), tokens in self.index.matched_tokens(prefix, ids, now).items():
                if tokens > matched.get(worker_id, (-1, 0))[0]:
                    matched[worker_id] = (tokens, rank)
        total = len(prefix) if prefix is not None else 0
        loads = [load_of(w, now, self.stale_after_s) for w in workers]
        uncached = [total - matched.get(w.id, (0, 0))[0] for w in workers]
        start = rotate_after(ids, self.last)
        order = [*range(start, len(ids)), *range(start)]
        pick = cheapest(loads, uncached, self.settings, order)
        chosen = workers[pick]
        self.last = chosen.id
        if prefix is not None:
            prefix.expected_cached = total - uncached[pick]
            hit = matched.get(chosen.id)
            if hit is not None and self.index.ranks(chosen.id) > 1:
                prefix.ranks[chosen.id] = hit[1]
        if prefix is not None:
            rank = matched.get(chosen.id, (0, 0))[1]
            self.index.assume((chosen.id, rank), prefix, now)
        return cast("C", chosen)
