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
                "gateway_discovery_last_success_timestamp_seconds",
                "unix time a source last answered (0 if it never did)",
                labels=["source"],
            ),
            GaugeMetricFamily(
                "gateway_discovery_seconds_since_success",
                "deprecated, removed in the next release: use time() - "
                "gateway_discovery_last_success_timestamp_seconds. Seconds since a source "
                "last answered (since start if it never did)",
                labels=["source"],
            ),
        ]

    def collect(self) -> Iterable[Any]:
        hosts, updates, errors, last, age = families = self._families()
        now, wall = time.monotonic(), time.time()
        for stats in list(self._stats()):
            hosts.add_metric([stats.name], float(stats.hosts))
            updates.add_metric([stats.name], float(stats.updates))
            errors.add_metric([stats.name], float(stats.errors))
            last.add_metric([stats.name], wall_time(stats.last_success, now, wall))
            age.add_metric([stats.name], stats.seconds_since_success(now))
        return families


def wall_time(stamp: float | None, now: float, wall: float) -> float:
    """A `time.monotonic()` stamp as unix time, given both clocks read now (0 for None)."""
    return 0.0 if stamp is None else wall - (now - stamp)
