"""The shared store's series, read at scrape time from the serving process's `Store` (its
operations count their own trouble: the only writer)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.state.store import REASONS, Store


class StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def describe(self) -> Iterable[Any]:
        return self._families()

    @staticmethod
    def _families() -> list[Any]:
        return [
            GaugeMetricFamily(
                "gateway_state_store_up",
                "1 while the shared store (state.url) answers; 0 while it is away (each "
                "process serves on its own state meanwhile)",
            ),
            CounterMetricFamily(
                "gateway_state_store_errors",
                "store operations that failed, by operation and reason: unreachable, "
                "timeout (past state.timeout_s), invalid (a value that is no value of ours, "
                "refused)",
                labels=["operation", "reason"],
            ),
            CounterMetricFamily(
                "gateway_state_store_writes_dropped",
                "background writes (settlements, bindings) dropped: too many at once",
            ),
        ]

    def collect(self) -> Iterable[Any]:
        up, errors, dropped = families = self._families()
        store = self._store
        up.add_metric([], 1.0 if store.up else 0.0)
        counts = dict(store.errors)  # one C call: safe against the loop's writes
        for operation in sorted({operation for operation, _ in counts}):
            for reason in REASONS:  # every reason of an operation shown, at 0 too
                errors.add_metric([operation, reason], float(counts.get((operation, reason), 0)))
        dropped.add_metric([], float(store.dropped_writes))
        return families
