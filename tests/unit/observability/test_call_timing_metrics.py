"""Per-call series fed by the record: the call's duration, the mean gap between a stream's
messages (one observation per call) and the tokens it generated. Records in, samples out."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gateway.app.metrics import Metrics
from gateway.core import verdicts
from gateway.observability.metrics.calls import DURATION_BUCKETS, INTER_TOKEN_BUCKETS
from gateway.observability.record import CallRecord, mean_gap
from tests.support.factories import make_registry

SGL = "sglang.grpc.scheduler.SglangScheduler"
VLLM = "vllm.grpc.engine.VllmEngine"
DURATION = "gateway_request_duration_seconds"
GAP = "gateway_inter_token_seconds"
GENERATED = "gateway_generated_tokens_total"


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(make_registry(), CollectorRegistry())


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.prometheus.get_sample_value(name, labels)


def ended(seconds_ago: float, **fields: Any) -> CallRecord:
    """A record of a call that started `seconds_ago` (it ends when observed)."""
    record = CallRecord(**fields)
    record.started = time.perf_counter() - seconds_ago
    return record


def test_buckets_span_milliseconds_to_minutes() -> None:
    assert DURATION_BUCKETS[0] == 0.005 and DURATION_BUCKETS[-1] == 600.0
    assert INTER_TOKEN_BUCKETS[0] == 0.001 and INTER_TOKEN_BUCKETS[-1] == 2.5
    for buckets in (DURATION_BUCKETS, INTER_TOKEN_BUCKETS):
        assert list(buckets) == sorted(set(buckets))


def test_duration_observed_once_per_call_by_model_service_rpc_code(metrics: Metrics) -> None:
    metrics.observe(ended(2.0, rpc="Generate", service=SGL, model="m"))
    metrics.observe(ended(0.0, rpc="Embed", service=VLLM, model="v", code="INTERNAL"))
    generate = {"model": "m", "service": SGL, "rpc": "Generate", "code": "OK"}
    assert value(metrics, f"{DURATION}_count", **generate) == 1
    assert value(metrics, f"{DURATION}_sum", **generate) == pytest.approx(2.0, abs=0.5)
    assert value(metrics, f"{DURATION}_bucket", le="1.0", **generate) == 0
    assert value(metrics, f"{DURATION}_bucket", le="2.5", **generate) == 1
    assert value(metrics, f"{DURATION}_bucket", le="+Inf", **generate) == 1
    embed = {"model": "v", "service": VLLM, "rpc": "Embed", "code": "INTERNAL"}
    assert value(metrics, f"{DURATION}_count", **embed) == 1
    assert value(metrics, f"{DURATION}_bucket", le="0.5", **embed) == 1
    # Every answered call has both its count and its duration.
    for labels in (generate, embed):
        assert value(metrics, "gateway_requests_total", **labels) == 1


def test_duration_of_a_refused_unknown_model_is_labelled_model_empty(metrics: Metrics) -> None:
    refused = verdicts.model_not_found("made-up", SGL, [])
    record = ended(0.0, rpc="Generate", service=SGL, model="made-up", code="NOT_FOUND")
    record.verdict = refused
    metrics.observe(record)
    labels = {"service": SGL, "rpc": "Generate", "code": "NOT_FOUND"}
    assert value(metrics, f"{DURATION}_count", model="", **labels) == 1
    assert value(metrics, f"{DURATION}_count", model="made-up", **labels) is None


def test_mean_gap_is_the_time_after_the_first_message_over_the_gaps() -> None:
    assert mean_gap(9.0, 1.0, 5) == 2.0
    assert mean_gap(1.5, 0.5, 2) == 1.0
    assert mean_gap(1.0, 1.0, 3) == 0.0
    assert mean_gap(3.0, 1.0, 1) is None  # one message: no gap
    assert mean_gap(3.0, 1.0, 0) is None


def test_inter_token_observed_once_per_stream_of_two_or_more(metrics: Metrics) -> None:
    # 9 s in all, the first message at 1 s, 4 gaps after it: 2 s each on average.
    metrics.observe(
        ended(9.0, rpc="Generate", service=SGL, model="m", first_message_s=1.0, messages=5)
    )
    where = {"model": "m", "service": SGL}
    assert value(metrics, f"{GAP}_count", **where) == 1
    assert value(metrics, f"{GAP}_sum", **where) == pytest.approx(2.0, abs=0.1)
    assert value(metrics, f"{GAP}_bucket", le="1.0", **where) == 0
    assert value(metrics, f"{GAP}_bucket", le="2.5", **where) == 1
    # One message, no message, not a stream: nothing observed.
    metrics.observe(
        ended(1.0, rpc="Generate", service=SGL, model="m", first_message_s=0.5, messages=1)
    )
    metrics.observe(ended(1.0, rpc="Generate", service=SGL, model="m", code="UNAVAILABLE"))
    metrics.observe(
        ended(1.0, rpc="Embed", service=SGL, model="m", first_message_s=0.5, messages=2)
    )
    assert value(metrics, f"{GAP}_count", **where) == 1
    # The first message's histogram still sees the one-message stream.
    assert value(metrics, "gateway_first_message_seconds_count", **where) == 2


def test_inter_token_help_says_how_it_is_computed(metrics: Metrics) -> None:
    [family] = [f for f in metrics.prometheus.collect() if f.name == GAP]
    assert family.type == "histogram"
    assert "one observation per call" in family.documentation
    assert "(end - first message) / (messages - 1)" in family.documentation


def test_generated_tokens_summed_from_generate_records(metrics: Metrics) -> None:
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m", completion_tokens=7))
    metrics.observe(CallRecord(rpc="Generate", service=VLLM, model="m", completion_tokens=5))
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="n", completion_tokens=0))
    metrics.observe(CallRecord(rpc="Generate", service=SGL, model="m"))  # no usage reported
    metrics.observe(CallRecord(rpc="Embed", service=SGL, model="e", completion_tokens=3))
    assert value(metrics, GENERATED, model="m") == 12
    assert value(metrics, GENERATED, model="n") == 0
    assert value(metrics, GENERATED, model="e") is None
