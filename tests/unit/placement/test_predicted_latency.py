"""Predicted-latency placement: cache-aware's choice while a worker's model is cold,
then the least predicted time to first token, which sends a call to an idle fast worker
rather than to a cached copy on a slow one; one placement in EXPLORE_EVERY explores."""

from __future__ import annotations

from gateway.config import KvConfig
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix
from gateway.placement.policies import Hints
from gateway.placement.policies.predicted_latency import EXPLORE_EVERY, PredictedLatency
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
