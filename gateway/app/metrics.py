"""The gateway's metrics in one registry, the process's own counters, and /metrics over
HTTP.

No series has a `_created` sample: every process that serves metrics imports this module,
which turns them off for the whole process. They would double the series of every counter
and histogram, and a sum over serving processes has no single creation time anyway."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    start_http_server,
)

from gateway.config import DEFAULT_TENANT_LABELS, parse_address
from gateway.discovery.metrics import DiscoveryCollector
from gateway.discovery.source import SourceStats
from gateway.flow.metrics import FlowCollector, FlowQueues, FlowSeries
from gateway.observability.metrics.calls import STREAMING_RPC, CallSeries
from gateway.observability.metrics.counts import RelayedMetadataCollector, TracingCollector
from gateway.observability.metrics.migration import KeptTokens, MigrationCollector
from gateway.observability.metrics.process import build_series, process_series
from gateway.observability.record import CallRecord, mean_gap
from gateway.placement.affinity import Affinity
from gateway.placement.metrics import AffinityCollector
from gateway.state.metrics import StoreCollector
from gateway.state.store import Store
from gateway.upstream.load.kv_metrics import KvCollector, KvSource
from gateway.upstream.lora_metrics import LoraCollector, LoraCounts
from gateway.upstream.metrics import FleetCollector
from gateway.upstream.registry import Registry

# Read at every scrape: this holds for every registry. (prometheus_client leaves it unannotated.)
disable_created_metrics()  # type: ignore[no-untyped-call]


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
        self._registry = registry
        self._calls = CallSeries(self.prometheus)
        self._flow = FlowSeries(self.prometheus, tenant_labels)
        self.prometheus.register(FleetCollector(registry))
        if kv is not None:
            self.prometheus.register(KvCollector(kv))
        process_series(self.prometheus)
        build_series(self.prometheus)
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
        # The endpoint picker's answers (gateway.picker), by what it answered.
        self._picker_answers = Counter(
            "gateway_picker_answers",
            "calls the endpoint picker answered, by answer: worker (Envoy sends it to the "
            "worker named), relay (to the gateway's relay, whole), verdict (refused by the "
            "picker itself, as the relay would)",
            ["answer"],
            registry=self.prometheus,
        )
        self._picker_children = {
            answer: self._picker_answers.labels(answer) for answer in ("worker", "relay", "verdict")
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

    def picker_answer(self, answer: str) -> None:
        """Count one answer of the endpoint picker (`Picker(count=metrics.picker_answer)`)."""
        child = self._picker_children.get(answer)
        if child is not None:
            child.inc()

    def auth_failure(self, reason: str) -> None:
        """Count one refused authentication (`ApiKeyAuth(count=metrics.auth_failure)`)."""
        child = self._auth_children.get(reason)
        if child is not None:
            child.inc()

    def observe(self, record: CallRecord) -> None:
        """Count one finished call (on the event loop: a few cached lookups, no allocation
        beyond the key tuples)."""
        self._calls.observe(record)
        if record.worker is not None:  # the worker whose answer the client got
            worker = self._registry.get(record.worker)
            if worker is not None:
                first = record.first_message_s if record.rpc == STREAMING_RPC else None
                gap = None
                if first is not None:
                    gap = mean_gap(record.duration_s(), first, record.messages)
                worker.calls.answered(record.code, first, gap)
                seen = record.placed_on
                predicted = seen.predicted_s if seen is not None else None
                if predicted is not None and first is not None and gap is not None:
                    worker.calls.predicted(predicted, first)  # a stream: its first message
        if record.priority is not None or record.tenant is not None:
            self._flow.observe(record)  # flow control or rate limits on

    def tracing(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Spans exported and dropped (`counts`: both, at scrape time)."""
        self.prometheus.register(TracingCollector(counts))

    def state(self, store: Store) -> None:
        """The shared store's health and trouble, at scrape time."""
        self.prometheus.register(StoreCollector(store))

    def affinity(self, affinity: Affinity) -> None:
        """Session affinity's outcomes and table size, at scrape time."""
        self.prometheus.register(AffinityCollector(affinity))

    def lora(self, loader: LoraCounts, registry: Registry) -> None:
        """LoRA adapter loads and evictions, and each worker's adapters, at scrape time."""
        self.prometheus.register(LoraCollector(loader, registry))

    def migration(self, budget: KeptTokens, reasons: Iterable[str]) -> None:
        """Migration's kept tokens and the streams no longer followed, at scrape time."""
        self.prometheus.register(MigrationCollector(budget, reasons))

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
