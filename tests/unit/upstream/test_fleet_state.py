"""The fleet's pure decisions: outlier detection, probe thresholds, status, overload,
health entries."""

from __future__ import annotations

import grpc
import pytest

from gateway.config import OutlierDetectionConfig, ProbeConfig, WorkerSpec
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.services.health import NOT_SERVING, SERVING, desired_statuses
from gateway.upstream.load.limits import WorkerLimits, overload_reason
from gateway.upstream.signals.load import LoadReport
from gateway.upstream.signals.outlier import Outcome, OutlierDetector, OutlierState, outcome_of
from gateway.upstream.signals.probe import ProbeKind, ProbeResult, ProbeState, judge
from gateway.upstream.worker import Worker, WorkerStatus, derive_status
from tests.support.factories import make_worker

S, F, IGN = Outcome.SUCCESS, Outcome.FAILURE, Outcome.IGNORED


def detector(failures: int = 3, cooldown: float = 10.0, successes: int = 2) -> OutlierDetector:
    return OutlierDetector(OutlierDetectionConfig(failures, cooldown, successes))


def state(b: OutlierDetector) -> OutlierState:
    """Its state now (read through a call: a type checker keeps no narrowing across the
    detector's own methods)."""
    return b.state


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (grpc.StatusCode.UNAVAILABLE, F),
        (grpc.StatusCode.INTERNAL, F),
        (grpc.StatusCode.DEADLINE_EXCEEDED, F),
        (grpc.StatusCode.INVALID_ARGUMENT, S),
        (grpc.StatusCode.NOT_FOUND, S),
        (grpc.StatusCode.OK, S),
        (grpc.StatusCode.CANCELLED, IGN),
    ],
)
def test_what_counts_against_a_worker(code: grpc.StatusCode, outcome: Outcome) -> None:
    assert outcome_of(code) is outcome


def test_outlier_detection_opens_after_n_consecutive_failures_only() -> None:
    b = detector()
    for outcome in (F, F, S, F, F):
        assert not b.record(outcome, 0.0, trial=False)
    assert state(b) is OutlierState.CLOSED
    assert b.record(F, 1.0, trial=False)
    assert state(b) is OutlierState.OPEN
    assert not b.admits(5.0)


def test_half_open_admits_exactly_one_trial_then_closes_after_m_successes() -> None:
    b = detector()
    for _ in range(3):
        b.record(F, 0.0, trial=False)
    assert b.admits(10.0)  # cool-down over
    assert b.on_dispatch(10.0)
    assert state(b) is OutlierState.HALF_OPEN
    assert not b.admits(10.0)  # one trial at a time
    assert not b.record(S, 10.5, trial=False)  # an old request's outcome says nothing
    assert not b.admits(10.5)
    assert not b.record(S, 11.0, trial=True)
    assert b.admits(11.0)
    b.on_dispatch(11.0)
    assert b.record(S, 11.5, trial=True)
    assert state(b) is OutlierState.CLOSED


def test_trial_failure_reopens_and_cancelled_trial_frees_the_slot() -> None:
    b = detector()
    for _ in range(3):
        b.record(F, 0.0, trial=False)
    b.on_dispatch(10.0)
    b.record(IGN, 10.1, trial=True)
    assert state(b) is OutlierState.HALF_OPEN and b.admits(10.1)
    b.on_dispatch(10.2)
    assert b.record(F, 10.3, trial=True)
    assert state(b) is OutlierState.OPEN
    assert not b.admits(15.0) and b.admits(20.3)


def result(kind: ProbeKind) -> ProbeResult:
    return ProbeResult(kind, kind.value)


def test_first_good_probe_makes_a_new_worker_healthy() -> None:
    state, settings = ProbeState(), ProbeConfig(success_threshold=3, failure_threshold=2)
    assert judge(state, result(ProbeKind.SERVING), settings) is True


def test_not_serving_is_believed_at_once_errors_need_the_threshold() -> None:
    settings = ProbeConfig(success_threshold=2, failure_threshold=2)
    state = ProbeState(healthy=True)
    assert judge(state, result(ProbeKind.ERROR), settings) is True
    assert judge(state, result(ProbeKind.ERROR), settings) is False
    state = ProbeState(healthy=True)
    assert judge(state, result(ProbeKind.NOT_SERVING), settings) is False


def test_recovery_needs_success_threshold_consecutive_probes() -> None:
    settings = ProbeConfig(success_threshold=2, failure_threshold=2)
    state = ProbeState(healthy=False)
    assert judge(state, result(ProbeKind.SERVING), settings) is False
    assert judge(state, result(ProbeKind.ERROR), settings) is False
    assert judge(state, result(ProbeKind.SERVING), settings) is False
    assert judge(state, result(ProbeKind.SERVING), settings) is True


def test_lost_connection_means_proving_health_again() -> None:
    state = ProbeState(healthy=True, successes=5)
    state.reset_for_reconnect()
    assert state.healthy is False and state.successes == 0
    pending = ProbeState()
    pending.reset_for_reconnect()
    assert pending.healthy is None


@pytest.mark.parametrize(
    ("draining", "connected", "healthy", "status"),
    [
        (False, False, None, WorkerStatus.PENDING),
        (False, True, None, WorkerStatus.PENDING),
        (False, True, True, WorkerStatus.READY),
        (False, False, True, WorkerStatus.NOT_READY),
        (False, True, False, WorkerStatus.NOT_READY),
        (True, True, True, WorkerStatus.DRAINING),
    ],
)
def test_status_follows_from_the_signals(
    draining: bool, connected: bool, healthy: bool | None, status: WorkerStatus
) -> None:
    assert derive_status(draining, connected, healthy) is status


def worker(inflight: int = 0, load: LoadReport | None = None) -> Worker:
    w = make_worker(WorkerSpec("h", 1))
    w.inflight, w.load = inflight, load
    return w


def test_overload_from_inflight_waiting_and_kv_usage() -> None:
    limits = WorkerLimits(max_inflight=4, max_waiting=10, max_token_usage=0.9)
    fresh = LoadReport(running=3, waiting=2, token_usage=0.5, at=100.0)
    assert overload_reason(worker(3, fresh), limits, 101.0, 3.0) is None
    assert overload_reason(worker(4, fresh), limits, 101.0, 3.0) == "4 in flight (limit 4)"
    busy = LoadReport(running=3, waiting=11, token_usage=0.5, at=100.0)
    assert overload_reason(worker(0, busy), limits, 101.0, 3.0) == "11 waiting (limit 10)"
    full = LoadReport(running=3, waiting=0, token_usage=0.95, at=100.0)
    assert overload_reason(worker(0, full), limits, 101.0, 3.0) == "KV usage 0.95 (limit 0.90)"


def test_a_stale_load_report_is_not_trusted_but_inflight_still_counts() -> None:
    limits = WorkerLimits(max_inflight=4, max_waiting=10)
    stale = LoadReport(running=3, waiting=50, token_usage=0.5, at=100.0)
    assert overload_reason(worker(0, stale), limits, 102.0, 3.0) is not None
    assert overload_reason(worker(0, stale), limits, 104.0, 3.0) is None
    assert overload_reason(worker(4, stale), limits, 104.0, 3.0) is not None


def test_with_flow_control_a_missing_or_stale_report_saturates_the_load_limits() -> None:
    waits = WorkerLimits(max_waiting=10, stale_saturates=True)
    stale = LoadReport(running=3, waiting=0, token_usage=0.5, at=100.0)
    assert overload_reason(worker(0, stale), waits, 102.0, 3.0) is None  # fresh, fits
    assert overload_reason(worker(0, stale), waits, 104.0, 3.0) == "no fresh load report"
    assert overload_reason(worker(0, None), waits, 104.0, 3.0) == "no fresh load report"
    # Without a load limit there is nothing a report would decide: no waiting for one.
    only_inflight = WorkerLimits(max_inflight=4, stale_saturates=True)
    assert overload_reason(worker(0, None), only_inflight, 104.0, 3.0) is None


def test_health_entries_from_the_fleet() -> None:
    servable = {
        ("a", Runtime.SGLANG): True,
        ("b", Runtime.SGLANG): False,
        ("v", Runtime.VLLM): False,
    }
    statuses = desired_statuses(
        False,
        {Runtime.SGLANG: ["a", "b"], Runtime.VLLM: ["v"]},
        lambda model, runtime: servable[(model, runtime)],
        engine_adapters(),
    )
    assert statuses == {
        "": SERVING,
        "liveness": SERVING,
        "readiness": SERVING,
        "sglang.grpc.scheduler.SglangScheduler": SERVING,
        "vllm.grpc.engine.VllmEngine": NOT_SERVING,
        "models/a": SERVING,
        "models/b": NOT_SERVING,
        "models/v": NOT_SERVING,
    }
    draining = desired_statuses(True, {Runtime.SGLANG: ["a"]}, lambda m, r: True, engine_adapters())
    assert set(draining.values()) == {NOT_SERVING}


def test_the_pickers_entry_is_live_whatever_the_fleet() -> None:
    picker = "envoy.service.ext_proc.v3.ExternalProcessor"
    statuses = desired_statuses(
        False, {Runtime.SGLANG: ["a"]}, lambda m, r: False, engine_adapters(), live=(picker,)
    )
    assert statuses[picker] == SERVING  # it answers every call: a verdict if need be
    assert statuses["readiness"] == NOT_SERVING
    draining = desired_statuses(
        True, {Runtime.SGLANG: ["a"]}, lambda m, r: True, engine_adapters(), live=(picker,)
    )
    assert draining[picker] == NOT_SERVING
