"""The prefix index per worker, and each worker's KV event stream, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.kv.index import KvIndex
from gateway.upstream.load.kv_events import KvFollower


class KvSource(Protocol):
    """What the KV collector reads: the index and each worker's follower."""

    @property
    def kv_index(self) -> KvIndex: ...

    @property
    def followers(self) -> Mapping[str, KvFollower]: ...


class KvCollector(Collector):
    """The prefix index per worker, and each worker's KV event stream, at scrape time."""

    def __init__(self, fleet: KvSource) -> None:
        self._fleet = fleet

    def describe(self) -> Iterable[Any]:
        return list(self._families())

    @staticmethod
    def _families() -> list[Any]:
        return [
            GaugeMetricFamily(
                "gateway_kv_index_blocks", "blocks the prefix index holds", labels=["worker"]
            ),
            CounterMetricFamily(
                "gateway_kv_events", "KV events applied, by kind", labels=["worker", "kind"]
            ),
            CounterMetricFamily(
                "gateway_kv_resyncs",
                "KV event subscriptions started over, by reason",
                labels=["worker", "reason"],
            ),
        ]

    def collect(self) -> Iterable[Any]:
        blocks, events, resyncs = families = self._families()
        try:
            followers = list(self._fleet.followers.items())
            for worker_id, follower in followers:
                blocks.add_metric([worker_id], float(self._fleet.kv_index.size(worker_id)))
                for kind, count in list(follower.events.items()):
                    events.add_metric([worker_id, kind], float(count))
                for reason, count in list(follower.resyncs.items()):
                    resyncs.add_metric([worker_id, reason], float(count))
        except RuntimeError:  # changed under the scrape (it runs in another thread)
            return self._families()
        return families
