"""Prometheus metrics: per-call counters fed by dispatch, fleet gauges read at scrape time.

Per call, `observe` costs a few dict lookups: label children are cached, so the hot path
never re-validates labels. Fleet gauges cost nothing per request: a custom collector reads
the registry when Prometheus scrapes. The scrape runs in the HTTP server's thread, so the
collector only copies what it reads and never changes fleet state.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.config import DEFAULT_TENANT_LABELS, parse_address
from gateway.discovery.metrics import DiscoveryCollector
from gateway.discovery.source import SourceStats
from gateway.flow.labels import TenantLabels
from gateway.kv.index import KvIndex
from gateway.observability.record import CallRecord
from gateway.placement.verdicts import Reason
from gateway.upstream.load.kv_events import KvFollower
from gateway.upstream.registry import Registry
from gateway.upstream.signals.outlier import OutlierState
from gateway.upstream.worker import Worker, WorkerStatus

# Time to first message of an LLM stream: prefill of a short prompt on an idle GPU is a few
# milliseconds; long prompts, queueing and PD handoff take seconds.
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    4.0,
    6.0,
    10.0,
    15.0,
    20.0,
    30.0,
)
OUTLIER_VALUE = {OutlierState.CLOSED: 0.0, OutlierState.HALF_OPEN: 1.0, OutlierState.OPEN: 2.0}
# A model no worker serves is named by the client: labelling it would let any client
# create series, so such calls carry model="" (the log line has the name).
CLIENT_NAMED = frozenset({Reason.MODEL_NOT_FOUND, Reason.MODEL_REQUIRED})
STREAMING_RPC = "Generate"


class KvSource(Protocol):
    """What the KV collector reads: the index and each worker's follower."""

    @property
    def kv_index(self) -> KvIndex: ...

    @property
    def followers(self) -> Mapping[str, KvFollower]: ...


class FleetCollector(Collector):
    """The registry's workers as gauges, computed at scrape time."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def describe(self) -> Iterable[Any]:
        return list(self._families())

    def collect(self) -> Iterable[Any]:
        families = self._families()
        up, status, outlier, inflight, running, waiting, usage, rejected = families
        for worker in self._workers():
            self._add(worker, up, status, outlier, inflight, running, waiting, usage, rejected)
        return families

    def _workers(self) -> list[Worker]:
        """Copy the worker list; the event loop may change the registry meanwhile."""
        for _ in range(3):
            try:
                return list(self._registry)
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        return []

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
                "gateway_worker_outlier_state",
                "outlier detection: 0 closed, 1 half_open (one trial call), 2 open (ejected)",
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
                "gateway_worker_load_rejected",
                "load figures of the worker's reports ignored as out of range (not "
                "finite, negative, overflowing)",
                labels=["worker"],
            ),
        ]

    @staticmethod
    def _add(
        worker: Worker,
        up: GaugeMetricFamily,
        status: GaugeMetricFamily,
        outlier: GaugeMetricFamily,
        inflight: GaugeMetricFamily,
        running: GaugeMetricFamily,
        waiting: GaugeMetricFamily,
        usage: GaugeMetricFamily,
        rejected: CounterMetricFamily,
    ) -> None:
        wid, current, load = worker.id, worker.status, worker.load  # one read of each
        ready = 1.0 if current is WorkerStatus.READY else 0.0
        up.add_metric([wid, worker.model, str(worker.runtime), str(worker.role)], ready)
        for each in WorkerStatus:
            status.add_metric([wid, each.value], 1.0 if each is current else 0.0)
        outlier.add_metric([wid], OUTLIER_VALUE.get(worker.outlier.state, 0.0))
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
            rejected.add_metric([wid], float(load.rejected))


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


class Metrics:
    """The gateway's metrics; `observe` once per finished call, `serve` to expose them."""

    def __init__(
        self,
        registry: Registry,
        prometheus_registry: CollectorRegistry | None = None,
        kv: KvSource | None = None,
        *,
        tenant_labels: int = DEFAULT_TENANT_LABELS,
    ) -> None:
        """`tenant_labels`: at most this many tenants are labelled by name at once in
        `gateway_flow_tenant_outcomes` (the rest as `other`), so its series stay bounded."""
        self.prometheus = (
            prometheus_registry if prometheus_registry is not None else CollectorRegistry()
        )
        self._requests = Counter(
            "gateway_requests",
            "calls answered, by final gRPC status code",
            ["model", "service", "rpc", "code"],
            registry=self.prometheus,
        )
        self._verdicts = Counter(
            "gateway_verdicts",
            "calls refused by placement, by verdict reason and leg",
            ["model", "reason", "leg"],
            registry=self.prometheus,
        )
        self._first_message = Histogram(
            "gateway_first_message_seconds",
            "time from call start to the first response message relayed (Generate)",
            ["model", "service"],
            buckets=TTFT_BUCKETS,
            registry=self.prometheus,
        )
        self._retries = Counter(
            "gateway_retries",
            "placements tried again on another worker after a retryable upstream failure",
            ["model", "service"],
            registry=self.prometheus,
        )
        self._handoff_failures = Counter(
            "gateway_pd_handoff_failures",
            "disaggregated requests failed by their KV hand-off (e.g. a vLLM prefill that "
            "returned no kv_transfer_params)",
            ["model", "reason"],
            registry=self.prometheus,
        )
        self._prompt_tokens = Counter(
            "gateway_prompt_tokens",
            "prompt tokens of requests placed cache-aware",
            ["model"],
            registry=self.prometheus,
        )
        self._hit_tokens = Counter(
            "gateway_prefix_hit_tokens",
            "of those, the tokens the gateway's prefix index expected cached where it placed",
            ["model"],
            registry=self.prometheus,
        )
        self._engine_cached = Counter(
            "gateway_engine_cached_tokens",
            "prompt tokens the engines reported cached in their answers, every Generate (set "
            "beside gateway_prefix_hit_tokens_total: what the index expected)",
            ["model"],
            registry=self.prometheus,
        )
        self._engine_cached_children: dict[tuple[str, ...], Any] = {}
        self._usage_rejected = Counter(
            "gateway_worker_usage_rejected",
            "Generate answers whose usage figure was past what the call could have used "
            "(counted as the bound instead), by figure: completion_tokens, cached_tokens",
            ["model", "figure"],
            registry=self.prometheus,
        )
        self._flow_wait = Histogram(
            "gateway_flow_wait_seconds",
            "time calls waited in a flow-control queue, by class (0 for those not waiting)",
            ["class"],
            buckets=WAIT_BUCKETS,
            registry=self.prometheus,
        )
        self._flow_outcomes = Counter(
            "gateway_flow_outcomes",
            "calls under flow control by class and how their wait ended: "
            + ", ".join(FLOW_OUTCOMES),
            ["class", "outcome"],
            registry=self.prometheus,
        )
        # By tenant, the label set bounded: the busiest tenants by name, the rest `other`;
        # a tenant that loses its name has its series removed.
        self._tenant_outcomes = Counter(
            "gateway_flow_tenant_outcomes",
            "calls under flow control or rate limits by tenant (at most "
            f"{tenant_labels} by name, the busiest of late; the rest as other) and how "
            "their wait ended: " + ", ".join(FLOW_OUTCOMES),
            ["tenant", "outcome"],
            registry=self.prometheus,
        )
        self._tenant_labels = TenantLabels(tenant_labels)
        self._tenant_children: dict[tuple[str, ...], Any] = {}
        self._flow_outcome_children: dict[tuple[str, ...], Any] = {}
        self._flow_wait_children: dict[tuple[str, ...], Any] = {}
        self._prompt_children: dict[tuple[str, ...], Any] = {}
        self._hit_children: dict[tuple[str, ...], Any] = {}
        self.prometheus.register(FleetCollector(registry))
        if kv is not None:
            self.prometheus.register(KvCollector(kv))
        self._request_children: dict[tuple[str, ...], Any] = {}
        self._verdict_children: dict[tuple[str, ...], Any] = {}
        self._first_children: dict[tuple[str, ...], Any] = {}
        self._retry_children: dict[tuple[str, ...], Any] = {}
        self.endpoint = Endpoint(self.prometheus)
        # Failed authentications on the main port (gateway.security.auth), by reason: every reason
        # shown from the start, at 0, so an alert can rate() it.
        self._auth_failures = Counter(
            "gateway_auth_failures",
            "calls refused by API-key authentication: missing, rejected, throttled",
            ["reason"],
            registry=self.prometheus,
        )
        self._auth_children = {
            reason: self._auth_failures.labels(reason)
            for reason in ("missing", "rejected", "throttled")
        }

        # Client connections on the main port, as the connection watch last counted them
        # (every 2 s), and the ones it closed past a peer's cap.
        self._connections = Gauge(
            "gateway_client_connections",
            "client connections open on the main port (counted every 2 s)",
            registry=self.prometheus,
        )
        self._connections_closed = Counter(
            "gateway_client_connections_closed_per_peer",
            "client connections closed because their peer address was past "
            "limits.max_connections_per_peer",
            registry=self.prometheus,
        )
        # ORCA StreamCoreMetrics streams refused (gateway.orca), by the share that was full.
        self._orca_refused = Counter(
            "gateway_orca_streams_refused",
            "StreamCoreMetrics streams refused RESOURCE_EXHAUSTED, by the share that was "
            "full: gateway (orca.max_streams), connection, peer (a principal or address)",
            ["share"],
            registry=self.prometheus,
        )
        self._orca_refused_children = {
            share: self._orca_refused.labels(share) for share in ("gateway", "connection", "peer")
        }

    def discovery(self, stats: Callable[[], Iterable[SourceStats]]) -> None:
        """Series per discovery source (this process runs the sources)."""
        self.prometheus.register(DiscoveryCollector(stats))

    def connections(self, count: int, closed: int) -> None:
        """One census of client connections (`ConnectionWatch(report=metrics.connections)`)."""
        self._connections.set(count)
        if closed:
            self._connections_closed.inc(closed)

    def orca_refused(self, share: str) -> None:
        """Count one refused ORCA stream (`OrcaService(refused=metrics.orca_refused)`)."""
        child = self._orca_refused_children.get(share)
        if child is not None:
            child.inc()

    def relayed_metadata(self, dropped: Callable[[], Mapping[str, int]]) -> None:
        """Entries of workers' metadata not relayed, by kind (`dropped`: at scrape time)."""
        self.prometheus.register(RelayedMetadataCollector(dropped))

    def auth_failure(self, reason: str) -> None:
        """Count one refused authentication (`ApiKeyAuth(count=metrics.auth_failure)`)."""
        child = self._auth_children.get(reason)
        if child is not None:
            child.inc()

    def observe(self, record: CallRecord) -> None:
        """Count one finished call (on the event loop: a few cached lookups, no allocation
        beyond the key tuples)."""
        verdict = record.verdict
        model = record.model
        if verdict is not None and verdict.reason in CLIENT_NAMED:
            model = ""
        _child(
            self._request_children, self._requests, (model, record.service, record.rpc, record.code)
        ).inc()
        if verdict is not None:
            reason = (model, verdict.reason.name, verdict.leg)
            _child(self._verdict_children, self._verdicts, reason).inc()
        first = record.first_message_s
        if first is not None and record.rpc == STREAMING_RPC:
            where = (model, record.service)
            _child(self._first_children, self._first_message, where).observe(first)
        if record.retries:
            _child(self._retry_children, self._retries, (model, record.service)).inc(record.retries)
        expected = record.expected_cached_tokens
        if expected is not None:
            _child(self._prompt_children, self._prompt_tokens, (model,)).inc(record.prompt_tokens)
            _child(self._hit_children, self._hit_tokens, (model,)).inc(expected)
        if record.cached_tokens is not None:
            counter = _child(self._engine_cached_children, self._engine_cached, (model,))
            counter.inc(record.cached_tokens)
        for figure in record.usage_rejected:
            self._usage_rejected.labels(model, figure).inc()
        if record.handoff_failure:
            self._handoff_failures.labels(model, record.handoff_failure).inc()
        if record.priority is not None or record.tenant is not None:
            self._flow_observe(record)  # flow control or rate limits on

    def _flow_observe(self, record: CallRecord) -> None:
        """By class (flow control) and by tenant (flow control or rate limits)."""
        klass, tenant, outcome = record.priority, record.tenant, flow_outcome(record)
        if klass is not None:
            _child(self._flow_outcome_children, self._flow_outcomes, (klass, outcome)).inc()
            if record.queued_s is not None:
                _child(self._flow_wait_children, self._flow_wait, (klass,)).observe(record.queued_s)
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
        _child(self._tenant_children, self._tenant_outcomes, (label, outcome)).inc()

    def tracing(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Spans exported and dropped (`counts`: both, at scrape time)."""
        self.prometheus.register(TracingCollector(counts))

    def flow(self, queues: FlowQueues) -> None:
        """Queue depth per model and class, and bytes per model, at scrape time."""
        self.prometheus.register(FlowCollector(queues))

    def serve(self, listen: str) -> int:
        """Expose /metrics over HTTP on `listen` (HOST:PORT, port 0 allowed) in a daemon
        thread; returns the bound port. Raises OSError if it cannot bind."""
        return self.endpoint.serve(listen)

    def close(self) -> None:
        self.endpoint.close()


class Endpoint:
    """/metrics over HTTP for one registry, in a daemon thread (prometheus-client's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, listen: str) -> int:
        """Listen on `listen` (HOST:PORT, port 0 allowed); returns the bound port. Raises
        OSError if it cannot bind."""
        if self._server is not None:
            raise RuntimeError("metrics endpoint already serving")
        host, port = parse_address(listen, "metrics listen address")
        self._server, self._thread = start_http_server(port, addr=host, registry=self._registry)
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop and release the port (a no-op if not serving)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)


def _child(cache: dict[tuple[str, ...], Any], metric: Any, key: tuple[str, ...]) -> Any:
    """The labelled child of `metric` for `key`, looked up once and cached."""
    child = cache.get(key)
    if child is None:
        child = cache[key] = metric.labels(*key)
    return child
