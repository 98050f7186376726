"""Clusters: the workers of one (model, runtime, role), with their own policy and limits,
made with their first worker and dropped with their last. No channel anywhere: a worker
is only its signals."""

from __future__ import annotations

import dataclasses

from gateway.config import ModelSettings, WorkerSpec
from gateway.core.roles import Role, Runtime
from gateway.core.verdicts import Reason, Verdict
from gateway.placement.policies import Hints
from gateway.placement.policies.cache_aware import CacheAware
from gateway.placement.policies.least_inflight import LeastInflight
from gateway.placement.policies.round_robin import RoundRobin
from gateway.upstream.cluster import ClusterKey
from gateway.upstream.load.limits import WorkerLimits
from gateway.upstream.registry import Registry
from gateway.upstream.worker import Worker
from tests.support.factories import make_placer, make_registry, make_worker

SETTINGS = {
    "chat": ModelSettings(policy="cache_aware", max_inflight=2),
    "batch": ModelSettings(policy="round_robin"),
}


def registry() -> Registry:
    return make_registry(lambda model: SETTINGS.get(model, ModelSettings()))


def ready(
    registry: Registry,
    port: int,
    model: str,
    role: Role = Role.REGULAR,
    runtime: Runtime = Runtime.SGLANG,
) -> Worker:
    worker = make_worker(WorkerSpec("h", port, model, runtime), model, runtime, role=role)
    registry.add(worker)
    worker.probe.healthy = True
    worker.set_connected(True, "test")
    return worker


def test_a_worker_has_no_channel() -> None:
    fields = {f.name for f in dataclasses.fields(Worker)}
    assert "channel" not in fields and not hasattr(make_worker(WorkerSpec("h", 1)), "channel")


def test_a_cluster_is_made_with_its_first_worker_and_dropped_with_its_last() -> None:
    reg = registry()
    assert reg.cluster("chat", Runtime.SGLANG, Role.REGULAR) is None
    b = ready(reg, 2, "chat")
    a = ready(reg, 1, "chat")
    cluster = reg.cluster("chat", Runtime.SGLANG, Role.REGULAR)
    assert cluster is not None
    assert cluster.key == ClusterKey("chat", Runtime.SGLANG, Role.REGULAR)
    assert cluster.workers == (a, b)  # sorted by id, whatever the order they came in
    reg.remove(a)
    assert reg.cluster("chat", Runtime.SGLANG, Role.REGULAR) is cluster
    assert tuple(cluster.workers) == (b,)  # read afresh: mypy would keep the (a, b) from above
    reg.remove(b)
    assert reg.cluster("chat", Runtime.SGLANG, Role.REGULAR) is None
    assert reg.models() == []


def test_each_cluster_has_its_model_policy_and_limits() -> None:
    reg = registry()
    ready(reg, 1, "chat", Role.PREFILL)
    ready(reg, 2, "chat", Role.DECODE)
    ready(reg, 3, "batch")
    prefill = reg.cluster("chat", Runtime.SGLANG, Role.PREFILL)
    decode = reg.cluster("chat", Runtime.SGLANG, Role.DECODE)
    batch = reg.cluster("batch", Runtime.SGLANG, Role.REGULAR)
    assert prefill is not None and decode is not None and batch is not None
    assert isinstance(prefill.policy, CacheAware)
    assert isinstance(decode.policy, LeastInflight)  # the prompt's cache is the prefill's
    assert isinstance(batch.policy, RoundRobin)
    assert prefill.limits == WorkerLimits(max_inflight=2)
    # a decode also keeps within its worker's own running window
    assert decode.limits == WorkerLimits(max_inflight=2, within_window=True)
    assert batch.limits == WorkerLimits() and not batch.limits.any


def test_two_runtimes_of_one_model_are_two_clusters_with_their_own_rotation() -> None:
    reg = registry()
    s1, s2 = ready(reg, 1, "batch"), ready(reg, 2, "batch")
    v1 = ready(reg, 3, "batch", runtime=Runtime.VLLM)
    sglang = reg.cluster("batch", Runtime.SGLANG, Role.REGULAR)
    vllm = reg.cluster("batch", Runtime.VLLM, Role.REGULAR)
    assert sglang is not None and vllm is not None and sglang.policy is not vllm.policy
    placer = make_placer(reg)
    picks = [placer.place("batch", rt, Hints()) for rt in (Runtime.SGLANG, Runtime.VLLM) * 2]
    assert [getattr(p, "primary", p) for p in picks] == [s1, v1, s2, v1]


def test_the_limits_are_the_clusters_own_on_every_leg() -> None:
    """The encode leg spans runtimes: each encoder is held to its own cluster's limits."""
    limited = {"mm": ModelSettings(max_inflight=1)}
    reg = make_registry(lambda model: limited.get(model, ModelSettings()))
    ready(reg, 1, "mm")
    encoder = ready(reg, 2, "mm", Role.ENCODE)
    placer = make_placer(reg)
    encoder.reserve()
    verdict = placer.place("mm", Runtime.SGLANG, Hints(), items=("image",))
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.WORKERS_OVERLOADED
    assert verdict.message == "All 1 available encode workers for model 'mm' are overloaded"
    encoder.release()
    decision = placer.place("mm", Runtime.SGLANG, Hints(), items=("image",))
    assert not isinstance(decision, Verdict)
    assert [w for w, _ in decision.encoders] == [encoder]


def test_a_decode_takes_no_more_calls_than_its_running_window() -> None:
    """A decode past its window would queue a call whose prefill holds the KV on a lease:
    the window it reports bounds the gateway's calls to it (a prefill's and a regular
    worker's queue is the engine's business)."""
    reg = registry()
    prefill, decode = ready(reg, 1, "batch", Role.PREFILL), ready(reg, 2, "batch", Role.DECODE)
    regular = ready(reg, 3, "other")
    for worker in (prefill, decode, regular):
        worker.window, worker.inflight = 4, 4
    placer = make_placer(reg)
    verdict = placer.place("batch", Runtime.SGLANG, Hints())
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.WORKERS_OVERLOADED
    assert verdict.leg == "decode"
    decode.inflight = 3
    assert not isinstance(placer.place("batch", Runtime.SGLANG, Hints()), Verdict)
    assert not isinstance(placer.place("other", Runtime.SGLANG, Hints()), Verdict)
    decode.window, decode.inflight = None, 100  # a worker that says no window: no bound
    assert not isinstance(placer.place("batch", Runtime.SGLANG, Hints()), Verdict)
