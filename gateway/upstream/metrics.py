"""The registry's workers as gauges, read at scrape time (in the HTTP server's thread)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gateway.upstream.registry import Registry
from gateway.upstream.signals.outlier import OutlierState
from gateway.upstream.worker import Worker, WorkerStatus

# gateway_worker_outlier_state's codes (deprecated: gateway_worker_outlier is the state set).
OUTLIER_VALUE = {OutlierState.CLOSED: 0.0, OutlierState.HALF_OPEN: 1.0, OutlierState.OPEN: 2.0}


class FleetCollector(Collector):
    """The registry's workers as gauges, computed at scrape time."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def describe(self) -> Iterable[Any]:
        return list(self._families())

    def collect(self) -> Iterable[Any]:
        families = self._families()
        for worker in self._workers():
            self._add(worker, *families)  # in _families' order
        return families

    def _workers(self) -> list[Worker]:
        return workers_of(self._registry)

    @staticmethod
    def _families() -> list[Any]:
        return [
            GaugeMetricFamily(
                "gateway_worker_up",
                "1 if the worker is ready (routable), else 0",
                labels=["worker", "model", "runtime", "role"],
            ),
            GaugeMetricFamily(
                "gateway_worker_status",
                "1 for the worker's current status, 0 for the others",
                labels=["worker", "status"],
            ),
            GaugeMetricFamily(
                "gateway_worker_outlier",
                "outlier detection: 1 for the worker's current state, 0 for the others "
                "(closed, half_open: one trial call, open: ejected)",
                labels=["worker", "state"],
            ),
            GaugeMetricFamily(
                "gateway_worker_outlier_state",
                "deprecated, removed in the next release: use gateway_worker_outlier. Outlier "
                "detection: 0 closed, 1 half_open (one trial call), 2 open (ejected)",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "gateway_worker_inflight",
                "requests the gateway has in flight on the worker",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "gateway_worker_load_running",
                "running requests the worker last reported (GetLoads)",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "gateway_worker_load_waiting",
                "queued requests the worker last reported (GetLoads)",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "gateway_worker_kv_token_usage",
                "KV cache token usage (0..1) the worker last reported (GetLoads)",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "gateway_worker_requests",
                "calls whose answer came from the worker, by final gRPC status code (the "
                "series go with the worker)",
                labels=["worker", "code"],
            ),
            HistogramMetricFamily(
                "gateway_worker_first_message_seconds",
                "Generate calls answered by the worker: time from the call's start to the "
                "first response message relayed",
                labels=["worker"],
            ),
            HistogramMetricFamily(
                "gateway_worker_inter_token_seconds",
                "Generate streams of 2 or more messages answered by the worker: the mean gap "
                "between messages after the first, one observation per call",
                labels=["worker"],
            ),
            HistogramMetricFamily(
                "gateway_worker_ttft_prediction_error",
                "Generate streams the predicted_latency policy placed on the worker: "
                "|predicted - observed| / observed time to first message, one per call",
                labels=["worker"],
            ),
            CounterMetricFamily(
                "gateway_worker_load_rejected",
                "load figures of the worker's reports ignored as out of range (not "
                "finite, negative, overflowing), and its adapter lists cut at "
                "lora.max_listed_per_worker",
                labels=["worker"],
            ),
        ]

    @staticmethod
    def _add(
        worker: Worker,
        up: GaugeMetricFamily,
        status: GaugeMetricFamily,
        outlier: GaugeMetricFamily,
        outlier_code: GaugeMetricFamily,
        inflight: GaugeMetricFamily,
        running: GaugeMetricFamily,
        waiting: GaugeMetricFamily,
        usage: GaugeMetricFamily,
        requests: CounterMetricFamily,
        first: HistogramMetricFamily,
        gaps: HistogramMetricFamily,
        errors: HistogramMetricFamily,
        rejected: CounterMetricFamily,
    ) -> None:
        wid, current, load = worker.id, worker.status, worker.load  # one read of each
        ready = 1.0 if current is WorkerStatus.READY else 0.0
        up.add_metric([wid, worker.model, str(worker.runtime), str(worker.role)], ready)
        for each in WorkerStatus:
            status.add_metric([wid, each.value], 1.0 if each is current else 0.0)
        state = worker.outlier.state
        for other in OutlierState:
            outlier.add_metric([wid, other.value], 1.0 if other is state else 0.0)
        outlier_code.add_metric([wid], OUTLIER_VALUE.get(state, 0.0))
        inflight.add_metric([wid], float(worker.inflight))
        if load is not None:  # no report yet: absent, not zero
            # Reports are checked when made (LoadReport.checked); a number that is not
            # finite still never reaches the exposition.
            for family, value in (
                (running, float(load.running)),
                (waiting, float(load.waiting)),
                (usage, float(load.token_usage)),
            ):
                if math.isfinite(value):
                    family.add_metric([wid], value)
        calls = worker.calls
        for code, count in list(calls.codes.items()):  # a copy: the loop may add a code
            requests.add_metric([wid, code], float(count))
        first.add_metric([wid], calls.first.cumulative(), calls.first.total)
        gaps.add_metric([wid], calls.gaps.cumulative(), calls.gaps.total)
        if any(calls.errors.counts):  # none predicted there: absent
            errors.add_metric([wid], calls.errors.cumulative(), calls.errors.total)
        if load is not None or worker.loras_rejected:
            reported = load.rejected if load is not None else 0
            rejected.add_metric([wid], float(reported + worker.loras_rejected))


def workers_of(registry: Iterable[Worker]) -> list[Worker]:
    """A copy of the registry's workers for a scrape (which runs off the event loop: the
    loop may change the registry meanwhile)."""
    for _ in range(3):
        try:
            return list(registry)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return []
