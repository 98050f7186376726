"""Migration's kept tokens: what all streams keep of their relayed token ids, and the
streams no longer followed, by why; read at scrape time from the serving process's
`TokenBudget` (proxy/migration.py: its streams are the only writers)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class KeptTokens(Protocol):
    """What the budget counts (proxy/migration.py's `TokenBudget`)."""

    @property
    def held(self) -> int: ...

    @property
    def unfollowed(self) -> Mapping[str, int]: ...


class MigrationCollector(Collector):
    def __init__(self, budget: KeptTokens, reasons: Iterable[str]) -> None:
        self._budget = budget
        self._reasons = tuple(reasons)

    def describe(self) -> Iterable[Any]:
        return self._families()

    @staticmethod
    def _families() -> list[Any]:
        return [
            GaugeMetricFamily(
                "gateway_migration_kept_tokens",
                "relayed token ids the streams that could go on elsewhere keep (packed, "
                "~3 bytes each; at most migration.max_kept_tokens)",
            ),
            CounterMetricFamily(
                "gateway_migration_unfollowed",
                "streams no longer followed for migration (they relay on, and cannot go on "
                "elsewhere), by reason: too_long (migration.max_resent_tokens), budget "
                "(migration.max_kept_tokens), undecodable (an answer of the worker did not "
                "decode)",
                labels=["reason"],
            ),
        ]

    def collect(self) -> Iterable[Any]:
        kept, unfollowed = families = self._families()
        kept.add_metric([], float(self._budget.held))
        counts = dict(self._budget.unfollowed)  # one C call: safe against the loop's writes
        for reason in self._reasons:  # every reason shown, at 0 too, for rate()
            unfollowed.add_metric([reason], float(counts.get(reason, 0)))
        return families
