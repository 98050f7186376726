"""Predicted-latency placement: each candidate's time to first token (and, for a call
with a pace objective, time per output token) predicted by its worker's own model
(`gateway.upstream.latency`: learned online from the gateway's observations of that
worker, by the prompt tokens it would prefill there, its prefill backlog and its load).
The candidate predicted to answer first wins, cache-aware's choice on a tie. A hit on a
slow or saturated worker loses to a miss on an idle fast one, which cache-aware
placement, weighing every worker alike, cannot see; the balance guard is the
predictions' own: a worker's backlog and load raise its predicted time as calls pile
on. (A margin before leaving cache-aware's choice, 1.25x + 5 ms, was measured first:
it kept slow workers' tails, TTFT p90 0.72-0.81x cache-aware's on a half-slow fleet
against 0.54-0.64x without it.)

Latency objectives (`x-slo-ttft-ms`, `x-slo-tpot-ms`: `Hints.slo`): a choice predicted
to miss them gives way to the candidate with the most headroom (the smallest fraction of
an objective left, the largest first). If even that one is predicted to miss and the call
is sheddable, the answer is `Unattainable` (the call is refused SLO_UNATTAINABLE); any
other call goes where it has the most headroom.

Cold start: while any candidate's model has too few observations (a new worker, a fresh
gateway), the call is placed as `cache_aware` places it, so the models learn from
placements that make sense (and no call is refused for its objectives: not every
candidate is predicted), unless that choice is warm and another warm candidate is
predicted to answer sooner.

Exploring, one call in `EXPLORE_EVERY`: while a candidate is cold, the call goes to the
coldest if it has no more to prefill there than at cache-aware's choice (cache-aware
affinity alone would never warm a worker that holds none of the prompts; a prompt another
worker holds would be prefilled whole there). Once every model is warm, it goes where
`cache_aware` would place it (a worker the predictions avoid still gets observations, so
its model does not keep an old picture), unless that is predicted to miss the call's
objective where another candidate would meet it. Shedding comes first: a sheddable call
no candidate is predicted to serve in time is refused on the exploring turn too. A turn
not taken passes to the next call. Ties go to the prompt's rendezvous order, as
cache-aware ones do.

The cost per placement is cache-aware's plus, per candidate, what the worker is seen to
store of the prompt (a bisection of the index) and one or two predictions (a dot product
of four, and one of two)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Self, cast

from gateway.config import KvConfig
from gateway.core.slo import Slo
from gateway.kv.index import KvIndex
from gateway.observability.record import PlacedOn
from gateway.placement.policies.base import C, Choice, Hints, Policy, PolicyContext, Unattainable
from gateway.placement.policies.cache_aware import CacheAware, View, load_of
from gateway.placement.policies.least_inflight import LeastInflight
from gateway.upstream.latency import MIN_SEEN
from gateway.upstream.worker import Worker

EXPLORE_EVERY = 20  # one placement in this many goes by cache_aware's choice


class PredictedLatency(CacheAware):
    name = "predicted_latency"

    def __init__(self, index: KvIndex, settings: KvConfig, stale_after_s: float) -> None:
        super().__init__(index, settings, stale_after_s)
        self._turn = 0

    def choose(self, candidates: Sequence[C], hints: Hints) -> Choice[C] | Unattainable | None:
        """The candidate predicted to answer first (cache-aware's choice on a tie), or
        the one with the most headroom for the call's objectives, with its predicted time
        (logged beside the observed one: how good the predictions are)."""
        if not candidates:
            return None
        view = self.view(candidates, hints)
        usual = self.best(view)
        uncached = self.uncached(view)
        guesses = guessed(view, uncached)
        ttfts = every(guesses)
        self._turn = (self._turn + 1) % EXPLORE_EVERY
        slo = hints.slo
        pick = sooner(usual, guesses, view.order)
        if ttfts is not None and slo is not None:
            paces = paced(view.workers, view.loads) if slo.tpot_s is not None else None
            aimed = within(slo, pick, ttfts, paces, view.order)
            if isinstance(aimed, Unattainable):
                self._turn = passed_on(self._turn)
                return aimed
            pick = aimed
        explored = self.explore(view, usual, uncached, ttfts, slo) if self._turn == 0 else None
        if explored is not None:
            pick = explored
        stored = len(view.prefix) - uncached[pick] if view.prefix is not None else None
        return self.commit(view, pick, stored, guesses[pick])

    def explore(
        self,
        view: View,
        usual: int,
        uncached: Sequence[int],
        ttfts: Sequence[float] | None,
        slo: Slo | None,
    ) -> int | None:
        """This turn's exploring placement, or None: the next call explores instead, so
        exploring never costs a call what it would cost elsewhere.

        - A cold worker, if there is one and the call has no more to prefill there than
          at cache-aware's choice (a prompt no worker holds, or one the cold worker
          holds too). Sending it a prompt another worker holds made the call prefill it
          all, and every call behind it in that worker's queue wait: on a fresh mixed
          fleet, a tenant's system prompt explored onto a cold half-speed worker took
          190 ms and the next call there missed its objective too.
        - Else cache-aware's choice, unless that is predicted to miss the call's time-
          to-first-token objective where another candidate is predicted to meet it. A
          call predicted late everywhere (and not sheddable: a sheddable one was refused
          before it came here) explores: it loses nothing, and a worker the
          predictions avoid (a slow one, while prompts no worker holds come) still gets
          placements, and the prefixes that make it the faster choice for their next
          turns."""
        coldest = min(view.order, key=lambda i: view.workers[i].latency.seen)
        if view.workers[coldest].latency.seen < MIN_SEEN:
            if uncached[coldest] <= uncached[usual]:
                return coldest
        elif ttfts is None or slo is None:
            return usual
        else:
            rooms = [headroom(slo, t, None) for t in ttfts]
            if rooms[usual] >= 0 or max(rooms) < 0:  # met there, or missed everywhere
                return usual
        self._turn = passed_on(self._turn)
        return None

    def uncached(self, view: View) -> list[int]:
        """Each candidate's prompt tokens to prefill: the prompt less what the worker is
        seen to store of it. Not cache-aware's uncached tokens, which count placements
        not yet prefilled as cached (they steer a session back to its worker; for time,
        a prompt still in its prefill there saves nothing: it is computed again)."""
        prefix = view.prefix
        if prefix is None:
            return view.uncached
        total, index = len(prefix), self.index
        found = []
        for worker in view.workers:
            hit = view.matched.get(worker.id)
            stored = index.stored_tokens(prefix, (worker.id, hit[1]), hit[0]) if hit else 0
            found.append(total - stored)
        return found


def guessed(view: View, uncached: Sequence[int]) -> list[float | None]:
    """Each candidate's predicted seconds to its first message (`uncached`: its prompt
    tokens to prefill there); None for a cold one."""
    rows = zip(view.workers, uncached, view.backlogs, view.loads, strict=True)
    return [w.latency.predict(tokens, backlog, load) for w, tokens, backlog, load in rows]


def sooner(usual: int, guesses: Sequence[float | None], order: Sequence[int]) -> int:
    """Cache-aware's choice, unless it is warm and another warm candidate is predicted to
    answer sooner (the first of equals in `order`). With every model warm that is the
    fastest; while some are cold, a cold candidate is never judged, so cache-aware's
    choice alone warms it, and a warm one is not sent a prompt it must prefill whole
    beside a warm worker predicted to serve it from its cache (cache-aware's balance
    guard moves calls so: on a fresh mixed fleet two of the first 48 calls missed their
    objective by it, at 103 and 105 ms)."""
    there = guesses[usual]
    if there is None:
        return usual
    warm = [i for i in order if guesses[i] is not None]
    fastest = min(warm, key=lambda i: cast("float", guesses[i]))
    return fastest if cast("float", guesses[fastest]) < there else usual


def passed_on(turn: int) -> int:
    """The turn after an exploring turn not taken (a call shed, or an explore deferred):
    it passes to the next call. Shedding comes first: a sheddable call no worker is
    predicted to serve in time is refused on any turn, and exploring with it would place
    what the fleet cannot serve in time."""
    return EXPLORE_EVERY - 1 if turn == 0 else turn


def paced(workers: Sequence[Worker], loads: Sequence[float]) -> list[float] | None:
    """Each candidate's predicted seconds per output token with the call running there
    (its load plus this call); None while any is cold."""
    return every(w.latency.predict_pace(load + 1) for w, load in zip(workers, loads, strict=True))


def every(predictions: Iterable[float | None]) -> list[float] | None:
    """The predictions, or None if a model was cold for any of them."""
    found = list(predictions)
    return None if None in found else cast("list[float]", found)


def headroom(slo: Slo, ttft_s: float, tpot_s: float | None) -> float:
    """The smallest fraction of an objective a prediction leaves (below 0: missed); an
    objective without a prediction (a cold pace model) leaves all of it."""
    room = math.inf
    if slo.ttft_s is not None:
        room = (slo.ttft_s - ttft_s) / slo.ttft_s
    if slo.tpot_s is not None and tpot_s is not None:
        room = min(room, (slo.tpot_s - tpot_s) / slo.tpot_s)
    return room


def within(
    slo: Slo, pick: int, ttfts: Sequence[float], paces: Sequence[float] | None, order: Sequence[int]
) -> int | Unattainable:
    """`pick` if it is predicted to meet the objectives; else the candidate with the most
    headroom (ties in `order`), or `Unattainable` when even it misses and the call is
    sheddable."""

    def room(i: int) -> float:
        return headroom(slo, ttfts[i], paces[i] if paces is not None else None)

    if room(pick) >= 0:
        return pick
    most = max(order, key=room)  # the first of equals in order
    if room(most) >= 0:
        return most
    if slo.sheddable:
        return Unattainable(slo, ttfts[most], paces[most] if paces is not None else None)
    return most


class PacedDecode(Policy):
    """A `predicted_latency` model's decode leg: the decode worker predicted to give the
    call the shortest time per output token (its pace model, at its load plus this call),
    a `tpot` objective met where it can be (a sheddable call none is predicted to meet:
    `Unattainable`, on any turn). Cold models, and one placement in EXPLORE_EVERY, go by
    the least in flight, as a cache-aware model's decode leg does (the prompt's cache is
    the prefill's; time to first token is the prefill leg's)."""

    name = "predicted_pace"

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self.fallback = LeastInflight()
        self._turn = 0

    @classmethod
    def build(cls, context: PolicyContext) -> Self:
        return cls(context.stale_after_s)

    def choose(self, candidates: Sequence[C], hints: Hints) -> Choice[C] | Unattainable | None:
        if not candidates:
            return None
        workers = cast("Sequence[Worker]", candidates)  # placement's candidates are workers
        now = time.monotonic()
        loads = [load_of(w, now, self.stale_after_s) for w in workers]
        self._turn = (self._turn + 1) % EXPLORE_EVERY
        paces = paced(workers, loads)
        pick = 0
        if paces is not None:
            pick = min(range(len(paces)), key=lambda i: (paces[i], loads[i]))
            slo, pace = hints.slo, paces[pick]
            if slo is not None and slo.sheddable and slo.tpot_s is not None and pace > slo.tpot_s:
                self._turn = passed_on(self._turn)
                return Unattainable(slo, None, pace)
        if self._turn == 0 or paces is None:
            chosen = self.fallback.pick(candidates, hints)
            if chosen is None:
                return None
            pick = list(candidates).index(chosen)
        return Choice(candidates[pick], placed_on=PlacedOn(loads[pick], 0))
