"""Per-source discovery series, read at scrape time (from the HTTP server's thread: the
numbers are plain ints and floats, each read whole)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.discovery.source import SourceStats


class DiscoveryCollector(Collector):
    def __init__(self, stats: Callable[[], Iterable[SourceStats]]) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Any]:
        return self._families()

    @staticmethod
    def _families() -> list[Any]:
        return [
            GaugeMetricFamily(
                "gateway_discovery_hosts", "hosts a source listed last", labels=["source"]
            ),
            CounterMetricFamily(
                "gateway_discovery_updates",
                "answers of a source that updated its hosts (resolutions, watch events, reads)",
                labels=["source"],
            ),
            CounterMetricFamily(
                "gateway_discovery_errors",
                "failed resolutions, watches or reads (the last hosts stay)",
                labels=["source"],
            ),
            GaugeMetricFamily(
                "gateway_discovery_seconds_since_success",
                "seconds since a source last answered (since start if it never did)",
                labels=["source"],
            ),
        ]

    def collect(self) -> Iterable[Any]:
        hosts, updates, errors, age = families = self._families()
        now = time.monotonic()
        for stats in list(self._stats()):
            hosts.add_metric([stats.name], float(stats.hosts))
            updates.add_metric([stats.name], float(stats.updates))
            errors.add_metric([stats.name], float(stats.errors))
            age.add_metric([stats.name], stats.seconds_since_success(now))
        return families
