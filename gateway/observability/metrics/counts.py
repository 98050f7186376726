"""Counts kept elsewhere, read at scrape time: the OTLP exporter's spans, and the entries
of workers' metadata the relay did not pass on."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class TracingCollector(Collector):
    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def describe(self) -> Iterable[Any]:
        return self._families(0, 0)

    def collect(self) -> Iterable[Any]:
        return self._families(*self._counts())

    @staticmethod
    def _families(exported: int, dropped: int) -> list[Any]:
        return [
            CounterMetricFamily(
                "gateway_trace_spans_exported",
                "spans the OTLP exporter delivered to the collector",
                value=exported,
            ),
            CounterMetricFamily(
                "gateway_trace_spans_dropped",
                "spans dropped: the export queue was full, or the collector did not take them",
                value=dropped,
            ),
        ]


class RelayedMetadataCollector(Collector):
    """Entries of workers' headers and trailers not relayed (`MetadataRelay.dropped`)."""

    def __init__(self, dropped: Callable[[], Mapping[str, int]]) -> None:
        self._dropped = dropped

    def describe(self) -> Iterable[Any]:
        return [self._family()]

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "gateway_relayed_metadata_dropped",
            "entries of workers' response headers and trailers not relayed to the client "
            "(over upstream.max_relayed_metadata_bytes or _entries), by kind",
            labels=["kind"],
        )

    def collect(self) -> Iterable[Any]:
        family = self._family()
        for kind, count in dict(self._dropped()).items():
            family.add_metric([kind], float(count))
        return [family]
