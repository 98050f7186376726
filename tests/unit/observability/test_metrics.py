"""Metrics: exact sample values from CallRecords and from a hand-built fleet, and one real
scrape of the HTTP endpoint."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from gateway.app.metrics import Metrics
from gateway.config import OutlierDetectionConfig
from gateway.core import verdicts
from gateway.core.roles import Role, Runtime
from gateway.observability.metrics.calls import TTFT_BUCKETS
from gateway.observability.record import CallRecord
from gateway.upstream.registry import Registry
from gateway.upstream.signals.load import LoadReport
from gateway.upstream.signals.outlier import OutlierDetector, OutlierState
from gateway.upstream.worker import Worker, WorkerStatus
from tests.support.factories import make_registry, worker_on

SGL = "sglang.grpc.scheduler.SglangScheduler"
VLLM = "vllm.grpc.engine.VllmEngine"


def worker(
    port: int,
    model: str = "m",
    runtime: Runtime = Runtime.SGLANG,
    role: Role = Role.REGULAR,
) -> Worker:
    return worker_on(port, model, runtime, host="127.0.0.1", role=role)


def make_ready(registry: Registry, w: Worker) -> None:
    w.connected = True
    w.probe.healthy = True
    w.signalled("test")
    assert w.status is WorkerStatus.READY


@pytest.fixture
def fleet() -> Registry:
    return make_registry()


@pytest.fixture
def metrics(fleet: Registry) -> Metrics:
    return Metrics(fleet, CollectorRegistry())


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.prometheus.get_sample_value(name, labels)


def test_requests_counted_by_model_service_rpc_code(metrics: Metrics) -> None:
    for _ in range(3):
        metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m"))
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m", code="INTERNAL"))
    metrics.observe(CallRecord(rpc="Embed", service=VLLM, model="v"))
    total = "gateway_requests_total"
    assert value(metrics, total, model="m", service=SGL, rpc="Generate", code="OK") == 3
    assert value(metrics, total, model="m", service=SGL, rpc="Generate", code="INTERNAL") == 1
    assert value(metrics, total, model="v", service=VLLM, rpc="Embed", code="OK") == 1
    assert value(metrics, total, model="v", service=VLLM, rpc="Embed", code="INTERNAL") is None


def test_verdicts_counted_with_reason_and_leg(metrics: Metrics) -> None:
    refused = verdicts.leg_not_deployed("m", "decode")
    record = CallRecord(rpc="Generate", service=SGL, model="m", code="NOT_FOUND", verdict=refused)
    metrics.observe(record)
    metrics.observe(record)
    name = "gateway_verdicts_total"
    assert value(metrics, name, model="m", reason="LEG_NOT_DEPLOYED", leg="decode") == 2
    assert (
        value(
            metrics,
            "gateway_requests_total",
            model="m",
            service=SGL,
            rpc="Generate",
            code="NOT_FOUND",
        )
        == 2
    )


def test_client_named_unknown_model_is_not_a_label(metrics: Metrics) -> None:
    """Any client could otherwise create a series per made-up model name."""
    refused = verdicts.model_not_found("made-up-1", SGL, [])
    metrics.observe(
        CallRecord(
            rpc="Generate", service=SGL, model="made-up-1", code="NOT_FOUND", verdict=refused
        )
    )
    name = "gateway_verdicts_total"
    assert value(metrics, name, model="", reason="MODEL_NOT_FOUND", leg="") == 1
    assert value(metrics, name, model="made-up-1", reason="MODEL_NOT_FOUND", leg="") is None


def test_first_message_histogram_is_for_generate_only(metrics: Metrics) -> None:
    assert TTFT_BUCKETS[0] == 0.005 and TTFT_BUCKETS[-1] == 30.0
    for seconds in (0.004, 0.02, 0.2, 12.0):
        metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m", first_message_s=seconds))
    metrics.observe(CallRecord(rpc="Embed", service=SGL, model="m", first_message_s=0.1))
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m", code="UNAVAILABLE"))
    name = "gateway_first_message_seconds"
    labels = {"model": "m", "service": SGL}
    assert value(metrics, f"{name}_count", **labels) == 4
    assert value(metrics, f"{name}_sum", **labels) == pytest.approx(12.224)
    assert value(metrics, f"{name}_bucket", le="0.005", **labels) == 1
    assert value(metrics, f"{name}_bucket", le="0.025", **labels) == 2
    assert value(metrics, f"{name}_bucket", le="0.25", **labels) == 3
    assert value(metrics, f"{name}_bucket", le="10.0", **labels) == 3
    assert value(metrics, f"{name}_bucket", le="15.0", **labels) == 4
    assert value(metrics, f"{name}_bucket", le="+Inf", **labels) == 4


def test_retries_count_only_retries_not_legs_or_targets(metrics: Metrics) -> None:
    name = "gateway_retries_total"
    pd = CallRecord(rpc="Generate", service=SGL, model="m", attempts=1)
    pd.called(Role.PREFILL, "p")
    pd.called(Role.DECODE, "d")
    pd.called(Role.ENCODE, "e")
    fan_out = CallRecord(rpc="GetLoads", service=SGL, model="m", targets=["a", "b", "c"])
    metrics.observe(pd)
    metrics.observe(fan_out)
    assert value(metrics, name, model="m", service=SGL) is None
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m", attempts=3, retries=2))
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m", attempts=2, retries=1))
    assert value(metrics, name, model="m", service=SGL) == 3


def test_fleet_gauges_read_at_scrape_time(fleet: Registry, metrics: Metrics) -> None:
    ready = worker(1, "m", Runtime.SGLANG, Role.PREFILL)
    fleet.add(ready)
    make_ready(fleet, ready)
    ready.inflight = 4
    ready.load = LoadReport(running=3, waiting=2, token_usage=0.25, at=time.monotonic())
    pending = worker(2, "v", Runtime.VLLM)
    pending.outlier = OutlierDetector(OutlierDetectionConfig())
    pending.outlier.state = OutlierState.OPEN
    fleet.add(pending)

    w1, w2 = ready.id, pending.id
    up = "gateway_worker_up"
    assert value(metrics, up, worker=w1, model="m", runtime="sglang", role="prefill") == 1
    assert value(metrics, up, worker=w2, model="v", runtime="vllm", role="regular") == 0
    status = "gateway_worker_status"
    assert value(metrics, status, worker=w1, status="ready") == 1
    assert value(metrics, status, worker=w1, status="pending") == 0
    assert value(metrics, status, worker=w2, status="pending") == 1
    assert value(metrics, status, worker=w2, status="ready") == 0
    assert [value(metrics, status, worker=w2, status=s.value) for s in WorkerStatus].count(1.0) == 1
    assert value(metrics, "gateway_worker_outlier_state", worker=w1) == 0
    assert value(metrics, "gateway_worker_outlier_state", worker=w2) == 2
    assert value(metrics, "gateway_worker_inflight", worker=w1) == 4
    assert value(metrics, "gateway_worker_inflight", worker=w2) == 0
    assert value(metrics, "gateway_worker_load_running", worker=w1) == 3
    assert value(metrics, "gateway_worker_load_waiting", worker=w1) == 2
    assert value(metrics, "gateway_worker_kv_token_usage", worker=w1) == 0.25
    # No load report yet: the series are absent, not a misleading zero.
    assert value(metrics, "gateway_worker_kv_token_usage", worker=w2) is None
    assert value(metrics, "gateway_worker_load_running", worker=w2) is None

    # Live: the next scrape sees changes, and a removed worker is gone.
    ready.outlier.state = OutlierState.HALF_OPEN
    fleet.remove(pending)
    assert value(metrics, "gateway_worker_outlier_state", worker=w1) == 1
    assert value(metrics, up, worker=w2, model="v", runtime="vllm", role="regular") is None


def test_default_registries_do_not_collide(fleet: Registry) -> None:
    first, second = Metrics(fleet), Metrics(fleet)
    first.observe(CallRecord(rpc="Generate", service=SGL, model="m"))
    assert second.prometheus is not first.prometheus
    labels = {"model": "m", "service": SGL, "rpc": "Generate", "code": "OK"}
    assert second.prometheus.get_sample_value("gateway_requests_total", labels) is None


def test_http_endpoint_serves_the_series(fleet: Registry, metrics: Metrics) -> None:
    w = worker(7)
    fleet.add(w)
    make_ready(fleet, w)
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m"))
    port = metrics.serve("127.0.0.1:0")
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            body = reply.read().decode()
        assert (
            'gateway_requests_total{code="OK",model="m",rpc="Generate",'
            f'service="{SGL}"}} 1.0' in body
        )
        assert (
            f'gateway_worker_up{{model="m",role="regular",runtime="sglang",worker="{w.id}"}} 1.0'
            in body
        )
    finally:
        metrics.close()
    # The port is released: serving again works.
    again = metrics.serve(f"127.0.0.1:{port}")
    metrics.close()
    assert again == port
