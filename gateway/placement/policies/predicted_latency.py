"""Predicted-latency placement: each candidate's time to first token predicted by its
worker's own model (`gateway.upstream.latency`: learned online from the gateway's
observations of that worker, by uncached prompt tokens and load). Cache-aware's choice
stands unless another candidate is predicted clearly faster (`worth_it`): then that one
wins. A hit on a slow or saturated worker loses to a miss on an idle fast one, which
cache-aware placement, weighing every worker alike, cannot see; on a fleet of like
workers it places as cache-aware does.

Cold start: while any candidate's model has too few observations (a new worker, a fresh
gateway), the call is placed as `cache_aware` places it, so the models learn from
placements that make sense. One call in `EXPLORE_EVERY` explores: it goes to a cold
candidate if there is one (cache-aware affinity alone would never warm a worker that
holds none of the prompts), else as `cache_aware` would place it (a worker the
predictions avoid still gets observations, so its model does not keep an old
picture). Ties go to the prompt's rendezvous order, as cache-aware ones do. The cost
per placement is cache-aware's plus one prediction per candidate (a dot product of
four)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.config import KvConfig
from gateway.kv.index import KvIndex
from gateway.placement.policies.base import C, Choice, Hints
from gateway.placement.policies.cache_aware import CacheAware, View
from gateway.upstream.latency import MIN_SEEN

EXPLORE_EVERY = 20  # one placement in this many goes by cache_aware's choice
GAIN_RATIO = 1.25  # cache_aware's choice is left only when predicted this much slower
GAIN_SLACK_S = 0.005  # ... plus this


class PredictedLatency(CacheAware):
    name = "predicted_latency"

    def __init__(self, index: KvIndex, settings: KvConfig, stale_after_s: float) -> None:
        super().__init__(index, settings, stale_after_s)
        self._turn = 0

    def choose(self, candidates: Sequence[C], hints: Hints) -> Choice[C] | None:
        """Cache-aware's choice or a clearly faster one, with its predicted time (logged
        beside the observed one: how good the predictions are)."""
        if not candidates:
            return None
        view = self.view(candidates, hints)
        pick = self.best(view)
        model = view.workers[pick].latency
        predicted_s = model.predict(view.uncached[pick], view.backlogs[pick], view.loads[pick])
        chosen: Choice[C] = self.commit(view, pick)
        assert chosen.placed_on is not None  # cache-aware's commit always says
        return replace(chosen, placed_on=replace(chosen.placed_on, predicted_s=predicted_s))

    def best(self, view: View) -> int:
        self._turn = (self._turn + 1) % EXPLORE_EVERY
        usual = super().best(view)
        if self._turn == 0:  # explore: a cold worker gets a call, else cache-aware's pick
            coldest = min(view.order, key=lambda i: view.workers[i].latency.seen)
            return coldest if view.workers[coldest].latency.seen < MIN_SEEN else usual
        predictions = predicted(view)
        if predictions is None:
            return usual
        fastest = min(view.order, key=lambda i: predictions[i])
        return fastest if worth_it(predictions[usual], predictions[fastest]) else usual


def worth_it(usual_s: float, fastest_s: float) -> bool:
    """Leave cache-aware's choice only for a clear gain: its predicted time past
    GAIN_RATIO x the fastest's plus GAIN_SLACK_S (on a fleet of like workers the models
    agree within their error, and cache-aware's balance is kept)."""
    return usual_s > GAIN_RATIO * fastest_s + GAIN_SLACK_S


def predicted(view: View) -> list[float] | None:
    """Each candidate's predicted seconds to its first message; None while any is cold."""
    found = []
    rows = zip(view.workers, view.uncached, view.backlogs, view.loads, strict=True)
    for worker, uncached, backlog, load in rows:
        seconds = worker.latency.predict(uncached, backlog, load)
        if seconds is None:
            return None
        found.append(seconds)
    return found
