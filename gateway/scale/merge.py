"""One /metrics for several serving processes: merge their exposition texts.

Each serving process has its own CollectorRegistry, so the supervisor scrapes every process
and must show each process's numbers exactly once. What a process counts for itself (calls,
tokens, latency histograms, its own in-flight calls) adds up across processes. What every
process reports about the same worker (up, status, outlier state, the worker's load) does not: two
processes saying "up = 1" mean one worker that is up, so those gauges come from one process.
The processes' own resources (`process_*`: memory, CPU time, open file descriptors) add up
to the gateway's; of their start times the earliest is the gateway's, and of their file
descriptor limits the largest is shown.

`_created` samples are dropped. A sum of counters from processes that started at different
times has no single creation time: the earliest one would claim the merged series existed
unbroken since then, yet when any process restarts the sum falls and Prometheus sees a reset
anyway. Without `_created`, the merged counter is a plain monotonic-until-reset counter.

Sample timestamps are dropped too: the merged value is the value as of this scrape.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.peer.v1 import peer_pb2 as peer_pb
from gateway.peer.v1 import peer_pb2_grpc

log = structlog.get_logger("gateway.scale")

# Gauges every process reports alike (about the same worker, or the build): summing them
# would say "2 = up".
FIRST_WINS: frozenset[str] = frozenset(
    {
        "gateway_worker_up",
        "gateway_worker_status",
        "gateway_worker_outlier",
        "gateway_worker_outlier_state",
        "gateway_worker_load_running",
        "gateway_worker_load_waiting",
        "gateway_worker_kv_token_usage",
        "gateway_kv_index_blocks",
        "gateway_build_info",  # the same build everywhere: 1, not N
    }
)
# Gauges that are neither summed nor first-wins: how two processes' values combine.
Combine = Callable[[float, float], float]
COMBINED: Mapping[str, Combine] = {
    "process_start_time_seconds": min,  # since the oldest process: the gateway's start
    "process_max_fds": max,  # a limit, not an amount: a sum would be no one's limit
}

# Types whose text exposition carries `_created` timestamps (as a separate gauge family).
_WITH_CREATED = frozenset({"counter", "histogram", "summary"})

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class _Family:
    """One merged family: metadata from the first process that has it, values by sample."""

    name: str
    documentation: str
    type: str
    combine: Combine
    values: dict[_SampleKey, float] = field(default_factory=dict)

    def add(self, key: _SampleKey, value: float) -> None:
        kept = self.values.get(key)
        self.values[key] = value if kept is None else self.combine(kept, value)

    def metric(self) -> Metric:
        out = Metric(self.name, self.documentation, self.type)
        for (sample_name, labels), value in self.values.items():
            out.add_sample(sample_name, dict(labels), value)
        return out


def _first(kept: float, later: float) -> float:
    return kept


def _combine(family: Metric, first_wins: Collection[str]) -> Combine:
    """How one family's samples from two processes combine: summed unless it is a gauge
    named in `first_wins` or `COMBINED`."""
    if family.type != "gauge":
        return operator.add
    if family.name in first_wins:
        return _first
    return COMBINED.get(family.name, operator.add)


def _parse(text: str, index: int) -> list[Metric] | None:
    """All of one process's families, or None if any part of its text is malformed.

    The parser is a generator, so it is drained here: a text that breaks halfway must not
    leave its first half in the merge (a partial process would undercount silently)."""
    try:
        return list(text_string_to_metric_families(text))
    except Exception as exc:  # a sick process's scrape must not take /metrics down
        log.warning("metrics_text_unparsable", serving_process=str(index), error=repr(exc))
        return None


def merge_expositions(
    texts: Sequence[str], first_wins: Collection[str] = FIRST_WINS
) -> list[Metric]:
    """Merge the processes' exposition texts (text format 0.0.4, index 0 first) into families.

    Families match by name, samples by (sample name, sorted labels). Gauges named in
    `first_wins` take each sample from the lowest-index process that has it, those named in
    `COMBINED` the minimum or maximum; everything else (counters, histograms, summaries,
    untyped, other gauges) is summed, and summed histogram buckets, `_sum` and `_count` are
    again a valid histogram as long as the processes share a bucket layout (they run the
    same code). Summary quantiles do not add up, so they are
    dropped; `_count` and `_sum` are summed. `_created` is dropped (see the module docstring).

    A text that fails to parse is skipped whole: that process contributes nothing, the others
    are merged as usual. A family whose type differs from the first process's is skipped for
    that process. Type and help come from the first process that has the family; families
    keep their order of first appearance. The result can be returned from a collector's
    `collect()` and rendered by `generate_latest`.
    """
    parsed = [(i, families) for i, text in enumerate(texts) if (families := _parse(text, i))]
    # Text 0.0.4 renders `X_created` as a gauge family of its own right after X.
    created = {f.name + "_created" for _, fs in parsed for f in fs if f.type in _WITH_CREATED}
    merged: dict[str, _Family] = {}
    for index, families in parsed:
        for family in families:
            if family.type == "gauge" and family.name in created:
                continue
            entry = merged.get(family.name)
            if entry is None:
                entry = merged[family.name] = _Family(
                    family.name,
                    family.documentation,
                    family.type,
                    _combine(family, first_wins),
                )
            elif entry.type != family.type:
                log.warning(
                    "metrics_type_mismatch",
                    family=family.name,
                    expected=entry.type,
                    got=family.type,
                    serving_process=str(index),
                )
                continue
            for sample in family.samples:
                if sample.name == family.name + "_created":
                    continue
                if family.type == "summary" and "quantile" in sample.labels:
                    continue
                entry.add((sample.name, tuple(sorted(sample.labels.items()))), sample.value)
    return [entry.metric() for entry in merged.values()]


SCRAPE_TIMEOUT_S = 5.0


class Restarted(Protocol):
    """What the merged /metrics reads of a serving process's position."""

    index: int
    restarts: int


class ProcessesCollector(Collector):
    """Every serving process's metrics, merged (counters summed, worker states once),
    read at scrape time in the HTTP thread over the processes' control sockets; with
    `own`, the supervisor's own series are merged in too (its `process_*`, build)."""

    def __init__(
        self,
        addresses: Callable[[], list[str]],
        positions: Iterable[Restarted],
        timeout_s: float = SCRAPE_TIMEOUT_S,
        own: CollectorRegistry | None = None,
    ) -> None:
        self._addresses = addresses
        self._positions = list(positions)
        self._timeout_s = timeout_s
        self._own = own

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        channels = [grpc.insecure_channel(address) for address in self._addresses()]
        try:
            # All at once: a stuck process costs one timeout, not one each.
            asked = [
                peer_pb2_grpc.PeerServiceStub(ch).Metrics.future(
                    peer_pb.MetricsRequest(), timeout=self._timeout_s
                )
                for ch in channels
            ]
            texts = []
            for future in asked:
                try:
                    texts.append(future.result().text)
                except grpc.RpcError:
                    continue  # restarting or stuck: its counters come back with it
        finally:
            for ch in channels:
                ch.close()
        serving = GaugeMetricFamily(
            "gateway_serving_processes", "serving processes answering on the main port"
        )
        serving.add_metric([], float(len(texts)))
        restarts = CounterMetricFamily(
            "gateway_process_restarts", "serving processes restarted", labels=["process"]
        )
        for position in self._positions:
            restarts.add_metric([str(position.index)], float(position.restarts))
        own = [generate_latest(self._own).decode()] if self._own is not None else []
        return [*merge_expositions([*texts, *own]), serving, restarts]
