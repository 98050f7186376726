"""Flow control's series: each call's wait by class and by tenant (fed by the record),
and the queues' depth and bytes (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.core.verdicts import Reason
from gateway.flow.labels import TenantLabels
from gateway.observability.metrics.calls import child
from gateway.observability.record import CallRecord

WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Every value `flow_outcome` gives: an evicted tenant's series are removed by this list.
FLOW_OUTCOMES = (
    "admitted",
    "queue_full",
    "queue_timeout",
    "rate_limited",
    "shutting_down",
    "deadline",
    "cancelled",
)


FLOW_REASONS = frozenset(
    {Reason.QUEUE_FULL, Reason.QUEUE_TIMEOUT, Reason.RATE_LIMITED, Reason.SHUTTING_DOWN}
)


def flow_outcome(record: CallRecord) -> str:
    """How a flow-controlled call's wait ended (its class and the record say)."""
    reason = record.verdict.reason if record.verdict is not None else None
    if reason in FLOW_REASONS:
        return reason.error_code  # queue_full, queue_timeout, rate_limited, shutting_down
    if record.attempts == 0 and record.code == "DEADLINE_EXCEEDED":
        return "deadline"
    if record.attempts == 0 and record.code == "CANCELLED":
        return "cancelled"
    return "admitted"


class FlowQueues(Protocol):
    def depth(self) -> dict[tuple[str, str], int]: ...

    def queued_bytes(self) -> dict[str, int]: ...


class FlowSeries:
    """The flow-control outcomes and waits of finished calls, by class and by tenant."""

    def __init__(self, prometheus: CollectorRegistry, tenant_labels: int) -> None:
        self._flow_wait = Histogram(
            "gateway_flow_wait_seconds",
            "time calls waited in a flow-control queue, by class (0 for those not waiting)",
            ["class"],
            buckets=WAIT_BUCKETS,
            registry=prometheus,
        )
        self._flow_outcomes = Counter(
            "gateway_flow_outcomes",
            "calls under flow control by class and how their wait ended: "
            + ", ".join(FLOW_OUTCOMES),
            ["class", "outcome"],
            registry=prometheus,
        )
        # By tenant, the label set bounded: the busiest tenants by name, the rest `other`;
        # a tenant that loses its name has its series removed.
        self._tenant_outcomes = Counter(
            "gateway_flow_tenant_outcomes",
            "calls under flow control or rate limits by tenant (at most "
            f"{tenant_labels} by name, the busiest of late; the rest as other) and how "
            "their wait ended: " + ", ".join(FLOW_OUTCOMES),
            ["tenant", "outcome"],
            registry=prometheus,
        )
        self._tenant_labels = TenantLabels(tenant_labels)
        self._tenant_children: dict[tuple[str, ...], Any] = {}
        self._flow_outcome_children: dict[tuple[str, ...], Any] = {}
        self._flow_wait_children: dict[tuple[str, ...], Any] = {}

    def observe(self, record: CallRecord) -> None:
        """By class (flow control) and by tenant (flow control or rate limits)."""
        klass, tenant, outcome = record.priority, record.tenant, flow_outcome(record)
        if klass is not None:
            child(self._flow_outcome_children, self._flow_outcomes, (klass, outcome)).inc()
            if record.queued_s is not None:
                child(self._flow_wait_children, self._flow_wait, (klass,)).observe(record.queued_s)
        if tenant is not None:
            self._tenant_outcome(tenant, outcome)

    def _tenant_outcome(self, tenant: str, outcome: str) -> None:
        """Count one outcome under the tenant's bounded label, first removing the series
        of tenants that lost theirs (so at most `tenant_labels` + 1 tenants are live)."""
        label, evicted = self._tenant_labels.count(tenant)
        for gone in evicted:
            for each in FLOW_OUTCOMES:
                if self._tenant_children.pop((gone, each), None) is not None:
                    self._tenant_outcomes.remove(gone, each)
        child(self._tenant_children, self._tenant_outcomes, (label, outcome)).inc()


class FlowCollector(Collector):
    def __init__(self, queues: FlowQueues) -> None:
        self._queues = queues

    def describe(self) -> Iterable[Any]:
        return self._families()

    @staticmethod
    def _families() -> list[Any]:
        return [
            GaugeMetricFamily(
                "gateway_flow_queue_depth",
                "calls waiting for a worker, by model and class",
                labels=["model", "class"],
            ),
            GaugeMetricFamily(
                "gateway_flow_queue_bytes",
                "bytes of the requests waiting, by model",
                labels=["model"],
            ),
        ]

    def collect(self) -> Iterable[Any]:
        depth, size = families = self._families()
        try:
            for (model, klass), count in self._queues.depth().items():
                depth.add_metric([model, klass], float(count))
            for model, queued in self._queues.queued_bytes().items():
                size.add_metric([model], float(queued))
        except RuntimeError:  # changed under the scrape (it runs in another thread)
            return self._families()
        return families
