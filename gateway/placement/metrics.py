"""Session affinity's outcomes and table size, read at scrape time from the serving
process's `Affinity` (placement counts them as it places: the only writer)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.placement.affinity import Affinity, AffinityResult


class AffinityCollector(Collector):
    def __init__(self, affinity: Affinity) -> None:
        self._affinity = affinity

    def describe(self) -> Iterable[Any]:
        return self._families()

    @staticmethod
    def _families() -> list[Any]:
        return [
            CounterMetricFamily(
                "gateway_affinity",
                "legs placed for calls naming a session (affinity.header), by outcome: hit "
                "(its bound worker), miss (no binding: placed by the policy and bound), "
                "rebind (bound worker unavailable, failed in this call or over its limits: "
                "placed afresh and bound again)",
                labels=["model", "outcome"],
            ),
            GaugeMetricFamily(
                "gateway_affinity_sessions",
                "bindings (session, model, leg) the session table holds (expired ones until "
                "the next placement)",
            ),
        ]

    def collect(self) -> Iterable[Any]:
        outcomes, sessions = families = self._families()
        counts = dict(self._affinity.outcomes)  # one C call: safe against the loop's writes
        for model in sorted({model for model, _ in counts}):
            for kind in AffinityResult:  # every outcome of a model shown, at 0 too, for rate()
                outcomes.add_metric([model, kind.value], float(counts.get((model, kind), 0)))
        sessions.add_metric([], float(len(self._affinity.table)))
        return families
