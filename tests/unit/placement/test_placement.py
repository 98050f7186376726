"""Placement: model resolution and per-leg verdicts from a registry snapshot."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from gateway.config import ModelSettings, WorkerSpec
from gateway.core.roles import Role, Runtime
from gateway.core.verdicts import Reason, Verdict
from gateway.placement.placer import Placer
from gateway.placement.policies import Hints
from gateway.upstream.registry import Registry
from gateway.upstream.signals.outlier import Outcome
from gateway.upstream.worker import Worker, WorkerStatus
from tests.support.factories import make_placer, make_registry, make_worker


def add(registry: Registry, port: int, model: str, runtime: Runtime, ready: bool = True) -> Worker:
    worker = make_worker(WorkerSpec("h", port, model, runtime), model, runtime)  # no channel
    registry.add(worker)
    worker.connected = True
    worker.probe.healthy = ready
    worker.signalled("test")
    assert worker.status is (WorkerStatus.READY if ready else WorkerStatus.NOT_READY)
    return worker


def chosen(p: Placer, model: str, hints: Hints, exclude: Sequence[str] = ()) -> Worker | Verdict:
    """The worker a regular request goes to, or the verdict."""
    placed = p.place(model, Runtime.SGLANG, hints, exclude=exclude)
    return placed if isinstance(placed, Verdict) else placed.primary


@pytest.fixture
def registry() -> Registry:
    return make_registry()


def configured(policy: str = "round_robin", **limits: Any) -> Registry:
    """A registry whose clusters are made with this policy and these per-worker limits."""
    return make_registry(lambda model: ModelSettings(policy=policy, **limits), stale_after_s=6.0)


def placer(registry: Registry) -> Placer:
    return make_placer(registry, retry_after_ms=1500, load_interval_s=2.0, stale_after_s=6.0)


def test_named_model_resolves(registry: Registry) -> None:
    add(registry, 1, "m", Runtime.SGLANG)
    assert placer(registry).resolve("m", Runtime.SGLANG) == "m"


def test_single_model_is_the_default(registry: Registry) -> None:
    add(registry, 1, "m", Runtime.SGLANG)
    add(registry, 2, "v", Runtime.VLLM)
    assert placer(registry).resolve(None, Runtime.SGLANG) == "m"
    assert placer(registry).resolve(None, Runtime.VLLM) == "v"


def test_several_models_and_none_named_is_model_required(registry: Registry) -> None:
    add(registry, 1, "b", Runtime.SGLANG)
    add(registry, 2, "a", Runtime.SGLANG)
    verdict = placer(registry).resolve(None, Runtime.SGLANG)
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.MODEL_REQUIRED
    assert verdict.reason.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "(a, b)" in verdict.message


def test_model_on_the_other_protocol_says_where_it_is(registry: Registry) -> None:
    add(registry, 1, "m", Runtime.SGLANG)
    verdict = placer(registry).resolve("m", Runtime.VLLM)
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.MODEL_NOT_FOUND
    assert verdict.message == (
        "Model 'm' is not served over vllm.grpc.engine.VllmEngine; "
        "it is served over sglang.grpc.scheduler.SglangScheduler"
    )


def test_all_workers_down_is_workers_unavailable_with_retry_delay(registry: Registry) -> None:
    add(registry, 1, "m", Runtime.SGLANG, ready=False)
    add(registry, 2, "m", Runtime.SGLANG, ready=False)
    verdict = chosen(placer(registry), "m", Hints())
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.WORKERS_UNAVAILABLE
    assert verdict.leg == "regular"
    assert verdict.retry_after_ms == 1500
    assert verdict.message == (
        "All 2 regular workers for model 'm' are unavailable "
        "(not connected, unhealthy or ejected by outlier detection)"
    )


def test_retry_never_returns_a_tried_worker(registry: Registry) -> None:
    a = add(registry, 1, "m", Runtime.SGLANG)
    b = add(registry, 2, "m", Runtime.SGLANG)
    p = placer(registry)
    assert chosen(p, "m", Hints(), exclude=[a.id]) is b
    assert isinstance(chosen(p, "m", Hints(), exclude=[a.id, b.id]), Verdict)


def test_policy_declined_names_the_policy() -> None:
    registry = configured("manual")
    add(registry, 1, "m", Runtime.SGLANG)
    verdict = chosen(placer(registry), "m", Hints(target_worker="h:9"))
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.POLICY_DECLINED
    assert verdict.extra == {"policy": "manual"}


def test_each_model_has_its_own_rotation(registry: Registry) -> None:
    a1, a2 = add(registry, 1, "a", Runtime.SGLANG), add(registry, 2, "a", Runtime.SGLANG)
    b1 = add(registry, 3, "b", Runtime.SGLANG)
    p = placer(registry)
    assert chosen(p, "a", Hints()) is a1
    assert chosen(p, "b", Hints()) is b1
    assert chosen(p, "a", Hints()) is a2


def test_registry_drops_empty_branches_on_removal(registry: Registry) -> None:
    w = add(registry, 1, "m", Runtime.SGLANG)
    registry.remove(w)
    assert registry.models() == []
    assert registry.pool("m", Runtime.SGLANG, Role.REGULAR) == ()


def test_every_available_worker_over_its_limit_is_workers_overloaded() -> None:
    registry = configured(max_inflight=2)
    a, b = add(registry, 1, "m", Runtime.SGLANG), add(registry, 2, "m", Runtime.SGLANG)
    p = placer(registry)
    a.inflight = b.inflight = 2
    verdict = chosen(p, "m", Hints())
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.WORKERS_OVERLOADED
    assert verdict.retry_after_ms == 2000  # the load poll interval
    assert verdict.message == "All 2 available regular workers for model 'm' are overloaded"
    b.inflight = 1
    assert chosen(p, "m", Hints()) is b


def test_unavailable_wins_over_overloaded_when_nobody_is_available() -> None:
    registry = configured(max_inflight=1)
    a = add(registry, 1, "m", Runtime.SGLANG, ready=False)
    a.inflight = 9
    verdict = chosen(placer(registry), "m", Hints())
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.WORKERS_UNAVAILABLE


def test_an_ejected_worker_is_unavailable_though_ready(registry: Registry) -> None:
    a = add(registry, 1, "m", Runtime.SGLANG)
    for _ in range(a.outlier.settings.failure_threshold):
        a.outlier.record(Outcome.FAILURE, now=time.monotonic(), trial=False)
    verdict = chosen(placer(registry), "m", Hints())
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.WORKERS_UNAVAILABLE
    assert not placer(registry).servable("m")
