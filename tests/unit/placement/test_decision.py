"""Placement's answer is a value: the data-parallel rank and the expected cache hit come
back in the `Decision`, the request's hints are never written into, and the proxy puts
the request on the rank the decision names."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.config import ModelSettings
from gateway.core.roles import Role, Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix
from gateway.placement.decision import Decision
from gateway.placement.placer import Placer
from gateway.placement.policies import Hints
from gateway.proxy.job import Job
from gateway.upstream.registry import Registry
from tests.support.cache_aware import PROMPT, follower, stored
from tests.support.factories import make_placer, make_registry, worker_on


def cache_aware_placer(index: KvIndex) -> tuple[Placer, Registry]:
    registry = make_registry(lambda model: ModelSettings(policy="cache_aware"), index)
    return make_placer(registry), registry


def routable(registry: Registry, *workers: Any) -> None:
    for w in workers:
        registry.add(w)
        w.connected, w.probe.healthy = True, True
        w.signalled("test")


def test_the_decision_carries_the_rank_and_hit_and_the_hints_stay_as_they_were() -> None:
    index = KvIndex()
    index.follow(("h:1", 0))
    f = follower(index)
    batch = stored(1, [11, 12], PROMPT)
    batch.dp_rank = 1
    f.apply(batch)
    placer, registry = cache_aware_placer(index)
    busy = worker_on(2)
    busy.inflight = 5  # h:1 reports 2 running: the cached one is cheaper (6.8 vs 10.12)
    routable(registry, f.worker, busy)
    prefix = Prefix(PROMPT)
    hints = Hints(prefix=prefix)
    before = dataclasses.replace(hints)

    decision = placer.place("m", Runtime.SGLANG, hints)

    assert isinstance(decision, Decision)
    assert decision.lone is f.worker
    assert dict(decision.ranks) == {"h:1": 1}
    assert decision.expected_cached_tokens == 32
    assert decision.policy == "cache_aware"
    assert hints == before and not hasattr(prefix, "ranks")
    narrowed = decision.only(decision.receiver)
    assert narrowed.rank_of(f.worker) == 1 and narrowed.expected_cached_tokens == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.policy = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        decision.ranks["h:2"] = 0  # type: ignore[index]


def test_the_request_goes_to_the_rank_the_decision_names_and_only_there() -> None:
    adapter = engine_adapters()[Runtime.SGLANG]
    on_rank, other = worker_on(1), worker_on(2)
    decision = Decision(
        {Role.PREFILL: on_rank, Role.DECODE: other}, ranks={on_rank.id: 3}, policy="cache_aware"
    )
    unused: Any = None  # for_worker reads neither the call nor the sink
    job = Job(unused, adapter, b"", unused, "id")
    raw = adapter.rpcs["Generate"].request_type(request_id="r").SerializeToString()
    placed: Any = adapter.rpcs["Generate"].request_type.FromString(  # a generated message
        job.for_worker(raw, decision, on_rank)
    )
    assert placed.data_parallel_rank == 3 and placed.request_id == "r"
    assert job.for_worker(raw, decision, other) == raw  # no rank named: bytes untouched
