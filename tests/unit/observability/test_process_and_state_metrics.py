"""What the gateway's registry exposes beside the per-call series: the process's own
resources and build, outlier detection as a state set, discovery's freshness as a unix
time, and no `_created` series anywhere (text and OpenMetrics)."""

from __future__ import annotations

import platform
import time
from importlib.metadata import version

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app.metrics import Metrics
from gateway.discovery.metrics import DiscoveryCollector, wall_time
from gateway.discovery.source import SourceStats
from gateway.observability.record import CallRecord
from gateway.upstream.registry import Registry
from gateway.upstream.signals.outlier import OutlierState
from tests.support.factories import make_registry, worker_on

SGL = "sglang.grpc.scheduler.SglangScheduler"


@pytest.fixture
def fleet() -> Registry:
    return make_registry()


@pytest.fixture
def metrics(fleet: Registry) -> Metrics:
    return Metrics(fleet, CollectorRegistry())


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def help_of(registry: CollectorRegistry, name: str) -> str:
    [family] = [f for f in registry.collect() if f.name == name]
    return family.documentation


def test_process_series_of_this_process(metrics: Metrics) -> None:
    registry = metrics.prometheus
    assert (value(registry, "process_resident_memory_bytes") or 0) > 0
    assert (value(registry, "process_virtual_memory_bytes") or 0) > 0
    assert (value(registry, "process_cpu_seconds_total") or 0) > 0
    open_fds = value(registry, "process_open_fds")
    assert open_fds is not None and open_fds >= 1
    assert (value(registry, "process_max_fds") or 0) >= open_fds
    start = value(registry, "process_start_time_seconds")
    assert start is not None and start <= time.time()


def test_build_info_names_the_versions(metrics: Metrics) -> None:
    labels = {
        "version": version("grpc-model-gateway"),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }
    assert value(metrics.prometheus, "gateway_build_info", **labels) == 1
    [family] = [f for f in metrics.prometheus.collect() if f.name == "gateway_build_info"]
    assert family.type == "gauge" and len(family.samples) == 1


def test_no_created_series_in_text_or_openmetrics(metrics: Metrics) -> None:
    """Counters and histograms of every kind have samples, so `_created` would show."""
    record = CallRecord(rpc="Generate", service=SGL, model="m", first_message_s=0.1, messages=3)
    record.completion_tokens = 4
    metrics.observe(record)
    metrics.auth_failure("missing")
    text = generate_latest(metrics.prometheus).decode()
    assert "gateway_requests_total{" in text and "gateway_request_duration_seconds_bucket{" in text
    assert "_created" not in text
    assert not [f.name for f in text_string_to_metric_families(text) if f.name.endswith("_created")]
    openmetrics = om_generate_latest(metrics.prometheus)  # type: ignore[no-untyped-call]
    assert "_created" not in openmetrics.decode()


def test_outlier_state_set_one_for_the_current_state(fleet: Registry, metrics: Metrics) -> None:
    w = worker_on(1, host="127.0.0.1")
    fleet.add(w)
    registry = metrics.prometheus

    def states() -> dict[str, float | None]:
        return {
            s.value: value(registry, "gateway_worker_outlier", worker=w.id, state=s.value)
            for s in OutlierState
        }

    assert states() == {"closed": 1.0, "open": 0.0, "half_open": 0.0}
    for current, code in ((OutlierState.OPEN, 2.0), (OutlierState.HALF_OPEN, 1.0)):
        w.outlier.state = current
        assert states() == {s.value: 1.0 if s is current else 0.0 for s in OutlierState}
        # The deprecated code stays one more release, beside the state set.
        assert value(registry, "gateway_worker_outlier_state", worker=w.id) == code
    fleet.remove(w)
    assert set(states().values()) == {None}


def test_outlier_code_help_says_deprecated(metrics: Metrics) -> None:
    documentation = help_of(metrics.prometheus, "gateway_worker_outlier_state")
    assert documentation.startswith("deprecated") and "gateway_worker_outlier." in documentation


def test_wall_time_of_a_monotonic_stamp() -> None:
    assert wall_time(90.0, now=100.0, wall=1_000_000.0) == 999_990.0
    assert wall_time(None, now=100.0, wall=1_000_000.0) == 0.0


def test_discovery_last_success_timestamp_beside_the_deprecated_age() -> None:
    answered, silent = SourceStats("dns:a"), SourceStats("dns:b")
    before = time.time()
    answered.succeeded(hosts=2)
    after = time.time()
    registry = CollectorRegistry()
    registry.register(DiscoveryCollector(lambda: [answered, silent]))
    last = "gateway_discovery_last_success_timestamp_seconds"
    stamp = value(registry, last, source="dns:a")
    assert stamp is not None and before - 0.01 <= stamp <= after + 0.01
    assert value(registry, last, source="dns:b") == 0.0  # never answered
    age = value(registry, "gateway_discovery_seconds_since_success", source="dns:a")
    assert age is not None and 0.0 <= age < 5.0
    assert help_of(registry, "gateway_discovery_seconds_since_success").startswith("deprecated")
    assert last in help_of(registry, "gateway_discovery_seconds_since_success")
