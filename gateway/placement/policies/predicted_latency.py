"""Predicted-latency placement: each candidate's time to first token predicted by its
worker's own model (`gateway.upstream.latency`: learned online from the gateway's
observations of that worker, by uncached prompt tokens and load), the least wins. A hit
on a slow or saturated worker loses to a miss on an idle fast one, which cache-aware
placement, weighing every worker alike, cannot see.

Cold start: while any candidate's model has too few observations (a new worker, a fresh
gateway), the call is placed as `cache_aware` places it, so the models learn from
placements that make sense. Otherwise one call in `EXPLORE_EVERY` is placed as
`cache_aware` would too (bounded exploration: a worker the predictions avoid still gets
observations, so its model does not keep an old picture of it). Ties go to the prompt's
rendezvous order, as cache-aware ones do. The cost per placement is cache-aware's plus
one prediction per candidate (a dot product of three)."""

from __future__ import annotations

from gateway.config import KvConfig
from gateway.kv.index import KvIndex
from gateway.placement.policies.cache_aware import CacheAware, View

EXPLORE_EVERY = 20  # one placement in this many goes by cache_aware's choice


class PredictedLatency(CacheAware):
    name = "predicted_latency"

    def __init__(self, index: KvIndex, settings: KvConfig, stale_after_s: float) -> None:
        super().__init__(index, settings, stale_after_s)
        self._turn = 0

    def best(self, view: View) -> int:
        self._turn = (self._turn + 1) % EXPLORE_EVERY
        predictions = predicted(view)
        if predictions is None or self._turn == 0:
            return super().best(view)
        return min(view.order, key=lambda i: predictions[i])


def predicted(view: View) -> list[float] | None:
    """Each candidate's predicted seconds to its first message; None while any is cold."""
    found = []
    for worker, uncached, load in zip(view.workers, view.uncached, view.loads, strict=True):
        seconds = worker.latency.predict(uncached, load)
        if seconds is None:
            return None
        found.append(seconds)
    return found
