"""Predicted-latency placement: cache-aware's choice while a worker's model is cold,
then the least predicted time to first token, which sends a call to an idle fast worker
rather than to a cached copy on a slow one; one placement in EXPLORE_EVERY explores."""

from __future__ import annotations

import math

import pytest

from gateway.config import KvConfig
from gateway.core.slo import Slo
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix
from gateway.placement.policies import Choice, Hints, Unattainable
from gateway.placement.policies.predicted_latency import (
    EXPLORE_EVERY,
    PacedDecode,
    PredictedLatency,
    headroom,
    sooner,
    within,
)
from gateway.upstream.latency import MIN_SEEN
from gateway.upstream.worker import Worker
from tests.support.cache_aware import PROMPT
from tests.support.factories import worker_on


def warmed(worker: Worker, base_s: float, per_token_s: float) -> None:
    for i in range(MIN_SEEN * 4):
        uncached = (i % 8) * 256
        worker.latency.observe(uncached, (i % 5) * 100, i % 3, base_s + per_token_s * uncached)


def test_cold_models_place_as_cache_aware_then_predictions_decide() -> None:
    index = KvIndex()
    policy = PredictedLatency(index, KvConfig(), stale_after_s=3)
    fast, slow = worker_on(1), worker_on(2)
    first = policy.pick([fast, slow], Hints(prefix=Prefix(PROMPT)))
    cached = first  # cold: cache_aware's pick, and the prompt assumed cached there
    assert cached is not None
    assert policy.pick([fast, slow], Hints(prefix=Prefix(PROMPT))) is cached
    # Now the one holding the prompt answers in half a second whatever it is sent (a
    # throttled worker), the other prefills the whole prompt in a tenth of that.
    warmed(cached, 0.5, 1e-4)
    other = slow if cached is fast else fast
    warmed(other, 0.01, 1e-4)
    hints = Hints(prefix=Prefix(PROMPT))
    picks = [policy.pick([fast, slow], hints) for _ in range(EXPLORE_EVERY)]
    assert picks.count(other) >= EXPLORE_EVERY - 1  # one placement may explore


def test_objectives_keep_a_choice_that_meets_them_else_take_the_most_headroom() -> None:
    ttfts, paces, order = [0.30, 0.10, 0.20], [0.02, 0.05, 0.03], [0, 1, 2]
    assert within(Slo(ttft_s=0.4), 0, ttfts, None, order) == 0  # met: kept
    assert within(Slo(ttft_s=0.25), 0, ttfts, None, order) == 1  # missed: most headroom
    # Two objectives: the smaller fraction left counts (1: 60% of TTFT, but 0% of pace).
    assert within(Slo(ttft_s=0.25, tpot_s=0.05), 0, ttfts, paces, order) == 2
    # A cold pace model leaves the pace objective out.
    assert within(Slo(ttft_s=0.25, tpot_s=0.05), 0, ttfts, None, order) == 1
    assert headroom(Slo(ttft_s=0.2), 0.1, None) == pytest.approx(0.5)
    assert headroom(Slo(), 5.0, 1.0) == math.inf


def test_a_sheddable_call_no_one_can_serve_in_time_is_unattainable() -> None:
    ttfts, order = [0.30, 0.10, 0.20], [2, 1, 0]
    missed = within(Slo(ttft_s=0.05, sheddable=True), 0, ttfts, None, order)
    assert missed == Unattainable(Slo(ttft_s=0.05, sheddable=True), 0.10, None)
    assert isinstance(missed, Unattainable) and missed.late_s() == pytest.approx(0.05)
    # Not sheddable: never refused for its objectives, placed where it is least late.
    assert within(Slo(ttft_s=0.05), 0, ttfts, None, order) == 1
    # Equal headroom: the first in order.
    assert within(Slo(ttft_s=0.05), 0, [0.3, 0.3, 0.3], None, order) == 2


def test_while_cold_no_call_is_refused_for_its_objectives() -> None:
    policy = PredictedLatency(KvIndex(), KvConfig(), stale_after_s=3)
    one, two = worker_on(1), worker_on(2)
    hints = Hints(prefix=Prefix(PROMPT), slo=Slo(ttft_s=1e-6, sheddable=True))
    for _ in range(EXPLORE_EVERY):
        assert policy.pick([one, two], hints) is not None
    warmed(one, 0.5, 1e-4)
    warmed(two, 0.5, 1e-4)
    answers = [policy.choose([one, two], hints) for _ in range(2 * EXPLORE_EVERY)]
    assert all(isinstance(a, Unattainable) for a in answers)  # the exploring turns too


def test_shedding_comes_before_exploring_and_the_next_call_explores() -> None:
    """A sheddable call late everywhere is refused on the exploring turn as on any other
    (exploring with it would place what no worker is predicted to serve in time); the
    turn passes to the next call, which explores cache-aware's choice."""
    policy = PredictedLatency(KvIndex(), KvConfig(), stale_after_s=3)
    fast, slow = worker_on(1), worker_on(2)
    cached = policy.pick([fast, slow], Hints(prefix=Prefix(PROMPT)))  # cold: cache-aware's
    assert cached is not None
    warmed(cached, 0.5, 1e-4)
    warmed(slow if cached is fast else fast, 0.01, 1e-4)
    hopeless = Hints(prefix=Prefix(PROMPT), slo=Slo(ttft_s=1e-4, sheddable=True))
    for _ in range(EXPLORE_EVERY):
        assert isinstance(policy.choose([fast, slow], hopeless), Unattainable)
    # One of those calls fell on the exploring turn: the next call takes it.
    assert policy.pick([fast, slow], Hints(prefix=Prefix(PROMPT))) is cached


def test_the_decode_leg_sheds_a_pace_none_can_meet_on_every_turn() -> None:
    """The decode leg (`PacedDecode`): the worker predicted to pace the call fastest; a
    sheddable call whose pace objective none is predicted to meet is refused, on the
    exploring turn too, and the next call explores (the least in flight)."""
    policy = PacedDecode(stale_after_s=3)
    quick, slow = worker_on(1), worker_on(2)
    for load in range(MIN_SEEN * 2):
        quick.latency.observe_pace(load % 4, 0.01 + 0.001 * (load % 4))
        slow.latency.observe_pace(load % 4, 0.05 + 0.001 * (load % 4))
    met = Hints(slo=Slo(tpot_s=0.03, sheddable=True))
    answers = [policy.choose([slow, quick], met) for _ in range(EXPLORE_EVERY)]
    picks = [a.worker for a in answers if isinstance(a, Choice)]
    assert picks.count(quick) >= EXPLORE_EVERY - 1  # one placement explores
    hopeless = Hints(slo=Slo(tpot_s=0.001, sheddable=True))
    answers = [policy.choose([slow, quick], hopeless) for _ in range(EXPLORE_EVERY)]
    assert all(isinstance(a, Unattainable) for a in answers)
    # Not sheddable: placed, never refused for its objective.
    assert isinstance(policy.choose([slow, quick], Hints(slo=Slo(tpot_s=0.001))), Choice)


def test_exploring_never_costs_a_call_its_objective() -> None:
    """With every model warm, the exploring turn goes to cache-aware's choice unless that
    is predicted to miss the call's objective where another worker is predicted to meet
    it; then the next call explores."""
    index = KvIndex()
    policy = PredictedLatency(index, KvConfig(), stale_after_s=3)
    fast, slow = worker_on(1), worker_on(2)
    cached = policy.pick([fast, slow], Hints(prefix=Prefix(PROMPT)))  # cold: cache-aware's
    assert cached is not None
    other = slow if cached is fast else fast
    warmed(cached, 0.5, 1e-4)  # the worker holding the prompt takes half a second
    warmed(other, 0.01, 1e-4)
    tight = Hints(prefix=Prefix(PROMPT), slo=Slo(ttft_s=0.2))
    picks = [policy.pick([fast, slow], tight) for _ in range(3 * EXPLORE_EVERY)]
    assert picks.count(cached) == 0  # every exploring turn deferred
    # A call without an objective takes the deferred turn: it explores cache-aware's pick.
    assert policy.pick([fast, slow], Hints(prefix=Prefix(PROMPT))) is cached
    loose = Hints(prefix=Prefix(PROMPT), slo=Slo(ttft_s=2.0))  # met anywhere: explores
    picks = [policy.pick([fast, slow], loose) for _ in range(EXPLORE_EVERY)]
    assert picks.count(cached) == 1
    # Late anywhere (even the fast one takes ~0.01 s + the prompt): exploring costs the
    # call nothing, so it explores, and the avoided worker still gets its placements.
    hopeless = Hints(prefix=Prefix(PROMPT), slo=Slo(ttft_s=1e-4))
    picks = [policy.pick([fast, slow], hopeless) for _ in range(EXPLORE_EVERY)]
    assert picks.count(cached) == 1


def test_a_cold_worker_explores_only_with_a_call_that_costs_no_more_there() -> None:
    """A cold worker's exploring placement waits for a call with no more to prefill there
    than at cache-aware's choice (here a prompt no worker holds): exploring it with a
    prompt another worker holds would make it prefill the whole prompt."""
    policy = PredictedLatency(KvIndex(), KvConfig(balance_ratio=1000), stale_after_s=3)
    one, two, cold = worker_on(1), worker_on(2), worker_on(3)
    holder = policy.pick([one, two], Hints(prefix=Prefix(PROMPT)))
    assert holder is not None
    warmed(one, 0.01, 1e-4)
    warmed(two, 0.01, 1e-4)
    picks = [policy.pick([one, two, cold], Hints(prefix=Prefix(PROMPT))) for _ in range(40)]
    assert cold not in picks  # every exploring turn deferred: the cold one holds nothing
    fresh = Hints(prefix=Prefix([7, *PROMPT]))  # held nowhere: the same cost anywhere
    assert policy.pick([one, two, cold], fresh) is cold


def test_while_one_is_cold_a_warm_choice_gives_way_to_a_warm_one_predicted_sooner() -> None:
    """Cold start goes by cache-aware's choice; but where that is a warm worker and
    another warm one is predicted to answer sooner, the sooner one takes the call. A cold
    cache-aware choice is kept (nothing judges it)."""
    policy = PredictedLatency(KvIndex(), KvConfig(), stale_after_s=3)
    fast, slow, cold = worker_on(1), worker_on(2), worker_on(3)
    warmed(fast, 0.01, 1e-5)
    warmed(slow, 0.5, 1e-4)
    # A prompt no worker holds: cache-aware's choice is the rendezvous order's first.
    hints = Hints(prefix=Prefix(PROMPT))
    view = policy.view([fast, slow, cold], hints)
    usual = view.workers[policy.best(view)]
    chosen = policy.pick([fast, slow, cold], hints)
    assert chosen is (usual if usual is not slow else fast)
    guesses: list[float | None] = [0.5, 0.1, None]
    assert sooner(0, guesses, [0, 1, 2]) == 1
    assert sooner(2, guesses, [0, 1, 2]) == 2  # cold: kept
    assert sooner(1, guesses, [0, 1, 2]) == 1  # already the soonest
