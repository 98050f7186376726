"""Merging several processes' /metrics texts: exact values after a full round trip.

Each process is a real CollectorRegistry rendered by generate_latest; the merged families are
served by a collector in a fresh registry, rendered again and parsed back, so what is checked
is what Prometheus would scrape from the supervisor."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as om_text_string_to_metric_families,
)
from prometheus_client.parser import text_string_to_metric_families

from gateway.scale.merge import FIRST_WINS, merge_expositions

BUCKETS = (0.25, 0.5, 1.0)
Values = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Fixed:
    """A collector that serves the merged families, as the supervisor's would."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def process_text(
    requests: dict[tuple[str, str], float],
    observations: dict[str, Sequence[float]],
    up: dict[str, float],
    inflight: dict[str, float],
) -> str:
    """One serving process's exposition text, from a real registry."""
    registry = CollectorRegistry()
    counter = Counter("gateway_requests", "calls", ["model", "code"], registry=registry)
    for (model, code), n in requests.items():
        counter.labels(model, code).inc(n)
    histogram = Histogram(
        "gateway_first_message_seconds", "ttft", ["model"], buckets=BUCKETS, registry=registry
    )
    for model, seen in observations.items():
        for value in seen:
            histogram.labels(model).observe(value)
    up_gauge = Gauge("gateway_worker_up", "worker up", ["worker"], registry=registry)
    for worker, value in up.items():
        up_gauge.labels(worker).set(value)
    inflight_gauge = Gauge("gateway_worker_inflight", "in flight", ["worker"], registry=registry)
    for worker, value in inflight.items():
        inflight_gauge.labels(worker).set(value)
    # The gateway exposes no `_created` (gateway.observability.metrics turns them off), but
    # the merge must drop them from any text that has them: the inputs do.
    enable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        return generate_latest(registry).decode()
    finally:
        disable_created_metrics()  # type: ignore[no-untyped-call]


# Distinct values per process, so summing, first-wins and last-wins all give different numbers.
P0 = process_text(
    requests={("m", "OK"): 3, ("m", "UNAVAILABLE"): 1},
    observations={"m": [0.125, 0.75]},
    up={"w1": 1, "w2": 0},
    inflight={"w1": 2, "w2": 1},
)
P1 = process_text(
    requests={("m", "OK"): 5, ("n", "OK"): 7},
    observations={"m": [0.375, 2.0], "n": [0.25]},
    up={"w1": 0.5, "w3": 1},
    inflight={"w1": 4, "w3": 8},
)
P2 = process_text(
    requests={("m", "OK"): 11},
    observations={"m": [0.5]},
    up={"w1": 0.25, "w2": 3, "w3": 0.75},
    inflight={"w1": 16},
)


def render(families: list[Metric]) -> str:
    registry = CollectorRegistry()
    registry.register(Fixed(families))
    return generate_latest(registry).decode()


def values(text: str) -> Values:
    """Every sample of a text, keyed like the merge keys it."""
    out: Values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in out, f"sample {key} twice"
            out[key] = sample.value
    return out


def merged(texts: Sequence[str], **kwargs: frozenset[str]) -> tuple[str, Values]:
    text = render(merge_expositions(texts, **kwargs))
    return text, values(text)


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def test_inputs_carry_created_and_total() -> None:
    """The inputs have what the merge must handle, or the tests below prove less."""
    assert "gateway_requests_created{" in P0
    assert "gateway_first_message_seconds_created{" in P0
    assert "# TYPE gateway_requests_total counter" in P0


def test_counters_summed() -> None:
    _, got = merged([P0, P1, P2])
    assert got[key("gateway_requests_total", model="m", code="OK")] == 19.0
    assert got[key("gateway_requests_total", model="m", code="UNAVAILABLE")] == 1.0
    assert got[key("gateway_requests_total", model="n", code="OK")] == 7.0
    counter = {k: v for k, v in got.items() if k[0].startswith("gateway_requests")}
    assert len(counter) == 3


def test_counter_renders_total_once_and_no_created() -> None:
    text, got = merged([P0, P1])
    assert "# TYPE gateway_requests_total counter" in text
    assert "_total_total" not in text
    assert "_created" not in text
    assert got[key("gateway_requests_total", model="m", code="OK")] == 8.0
    [family] = [f for f in merge_expositions([P0, P1]) if f.name == "gateway_requests"]
    assert family.type == "counter"
    assert family.documentation == "calls"
    assert {s.name for s in family.samples} == {"gateway_requests_total"}


def test_histogram_summed() -> None:
    text, got = merged([P0, P1, P2])
    assert "# TYPE gateway_first_message_seconds histogram" in text
    name = "gateway_first_message_seconds"
    # m: P0 0.125, 0.75; P1 0.375, 2.0; P2 0.5
    m = {le: got[key(name + "_bucket", model="m", le=le)] for le in ("0.25", "0.5", "1.0", "+Inf")}
    assert m == {"0.25": 1.0, "0.5": 3.0, "1.0": 4.0, "+Inf": 5.0}
    assert got[key(name + "_count", model="m")] == 5.0
    assert got[key(name + "_sum", model="m")] == 0.125 + 0.75 + 0.375 + 2.0 + 0.5
    # n only in P1
    n = {le: got[key(name + "_bucket", model="n", le=le)] for le in ("0.25", "0.5", "1.0", "+Inf")}
    assert n == {"0.25": 1.0, "0.5": 1.0, "1.0": 1.0, "+Inf": 1.0}
    assert got[key(name + "_count", model="n")] == 1.0
    assert got[key(name + "_sum", model="n")] == 0.25


def test_first_wins_gauge_from_lowest_index() -> None:
    _, got = merged([P0, P1, P2])
    assert got[key("gateway_worker_up", worker="w1")] == 1.0  # P0, not 1.75
    assert got[key("gateway_worker_up", worker="w2")] == 0.0  # P0's 0 beats P2's 3
    assert got[key("gateway_worker_up", worker="w3")] == 1.0  # only P1 and P2: P1
    assert "gateway_worker_up" in FIRST_WINS


def test_inflight_gauge_summed() -> None:
    assert "gateway_worker_inflight" not in FIRST_WINS
    _, got = merged([P0, P1, P2])
    assert got[key("gateway_worker_inflight", worker="w1")] == 22.0
    assert got[key("gateway_worker_inflight", worker="w2")] == 1.0
    assert got[key("gateway_worker_inflight", worker="w3")] == 8.0


def test_first_wins_argument_is_honoured() -> None:
    _, got = merged([P0, P1, P2], first_wins=frozenset())
    assert got[key("gateway_worker_up", worker="w1")] == 1.75
    _, got = merged([P0, P1, P2], first_wins=frozenset({"gateway_worker_inflight"}))
    assert got[key("gateway_worker_inflight", worker="w1")] == 2.0


def test_unparsable_text_skipped_whole() -> None:
    # Valid for most of its length, broken at the end: none of it may count.
    broken = P1 + 'gateway_worker_up{worker="w9" 1\n'
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(broken))
    text, got = merged([P0, broken, P2])
    assert text == render(merge_expositions([P0, P2]))
    assert got[key("gateway_requests_total", model="m", code="OK")] == 14.0
    assert key("gateway_requests_total", model="n", code="OK") not in got
    assert got[key("gateway_worker_up", worker="w3")] == 0.75  # P1 gone: P2's
    assert got[key("gateway_worker_inflight", worker="w1")] == 18.0


def test_unparsable_first_text_hands_first_wins_to_next() -> None:
    _, got = merged(["# TYPE x nonsense\nx 1\n", P1])
    assert got[key("gateway_worker_up", worker="w1")] == 0.5
    assert not any(k[0] == "x" for k in got)


def test_all_unparsable_or_empty() -> None:
    assert merge_expositions([]) == []
    assert merge_expositions(["", "not a metric line {\n"]) == []


def test_family_order_and_help_from_first_appearance() -> None:
    a = "# HELP a first\n# TYPE a gauge\na 1\n"
    b = "# HELP b only in one\n# TYPE b gauge\nb 2\n# HELP a second\n# TYPE a gauge\na 3\n"
    families = merge_expositions([a, b])
    assert [(f.name, f.documentation, f.type) for f in families] == [
        ("a", "first", "gauge"),
        ("b", "only in one", "gauge"),
    ]
    assert values(render(families)) == {key("a"): 4.0, key("b"): 2.0}


def test_summary_and_untyped_summed_quantiles_dropped() -> None:
    text = '# TYPE rpc summary\nrpc{quantile="0.5"} 3\nrpc_sum 10\nrpc_count 4\nloose 2\n'
    families = merge_expositions([text, text.replace("10", "6")])
    assert [(f.name, f.type) for f in families] == [("rpc", "summary"), ("loose", "unknown")]
    assert values(render(families)) == {
        key("rpc_sum"): 16.0,
        key("rpc_count"): 8.0,
        key("loose"): 4.0,
    }


def test_type_mismatch_keeps_first_type() -> None:
    gauge = "# TYPE x gauge\nx 1\n"
    summary = "# TYPE x summary\nx_sum 2\nx_count 1\n"
    families = merge_expositions([gauge, summary, gauge])
    assert [(f.name, f.type) for f in families] == [("x", "gauge")]
    assert values(render(families)) == {key("x"): 2.0}


def test_openmetrics_render_accepts_merge() -> None:
    """The supervisor may be scraped with OpenMetrics negotiation: that renderer must work too."""
    registry = CollectorRegistry()
    registry.register(Fixed(merge_expositions([P0, P1])))
    # prometheus_client's OpenMetrics exposition and parser are unannotated.
    families = {
        f.name: f
        for f in om_text_string_to_metric_families(om_generate_latest(registry).decode())  # type: ignore[no-untyped-call]
    }
    counter = {
        (s.name, s.labels["model"], s.labels["code"]): s.value
        for s in families["gateway_requests"].samples
    }
    assert counter == {
        ("gateway_requests_total", "m", "OK"): 8.0,
        ("gateway_requests_total", "m", "UNAVAILABLE"): 1.0,
        ("gateway_requests_total", "n", "OK"): 7.0,
    }
    count = {
        s.labels["model"]: s.value
        for s in families["gateway_first_message_seconds"].samples
        if s.name.endswith("_count")
    }
    assert count == {"m": 4.0, "n": 1.0}
