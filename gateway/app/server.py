"""Assembles the gateway: fleet -> placement -> dispatch, fronted by the engine servicers,
plus its own health service, admin port and metrics endpoint; and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Mapping, Sequence

import structlog
from grpc import aio
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.admin.service import AdminService, start_admin_server
from gateway.app.connections import ConnectionWatch, raise_fd_limit
from gateway.app.memory import Trimmer
from gateway.app.metrics import Metrics
from gateway.app.transport import picker_options, server_options
from gateway.config import (
    DEFAULT_TENANT_LABELS,
    GatewayConfig,
    declared_models,
    named_models,
    routes_of,
    served_models,
    usable_cores,
)
from gateway.core.listen import CannotListen, bind
from gateway.core.member import Member
from gateway.core.offload import Offload
from gateway.core.tasks import TaskScope
from gateway.discovery.membership import Membership
from gateway.discovery.runner import Sources, grace_by_source
from gateway.discovery.source import Discovered
from gateway.engines import engine_adapters
from gateway.flow.budget import RateLimits
from gateway.observability.record import CallRecord
from gateway.observability.tracing import Tracing
from gateway.observability.tracing import enabled as tracing_enabled
from gateway.orca.report import OrcaReporter
from gateway.orca.service import SERVICE_NAME as ORCA_SERVICE
from gateway.orca.service import OrcaService
from gateway.peer.client import Siblings
from gateway.peer.service import PeerService
from gateway.picker.service import SERVICE as PICKER_SERVICE
from gateway.picker.service import Picker
from gateway.placement.affinity import Affinity
from gateway.placement.placer import Placer
from gateway.placement.policies import build_policy
from gateway.placement.routes import RouteTable
from gateway.proxy import (
    UNFOLLOWED,
    Admission,
    BootstrapRooms,
    DisaggregatedDispatch,
    Dispatcher,
    Door,
    EngineFront,
    IdleWatch,
    InflightTable,
    LoraLoader,
    MetadataRelay,
    Migrations,
    ReadGate,
    Routing,
    Upstreams,
    WaitingRooms,
)
from gateway.security.auth import ApiKeyAuth
from gateway.security.identity import Identities
from gateway.security.keys import ApiKeys
from gateway.security.tls import CertificateFiles, channel_credentials
from gateway.services.health import HealthService, desired_statuses
from gateway.upstream.manager import Fleet
from gateway.upstream.registry import CHANGES, EVERY, FleetEvent

log = structlog.get_logger("gateway")

HEALTH_SERVICE = "grpc.health.v1.Health"
ADMIN_STOP_GRACE_S = 0.2  # a graceful GOAWAY: control channels close without an error
SHUT_MARGIN_S = 0.25  # calls still queued this long before the grace ends are answered


def preflight(config: GatewayConfig) -> None:
    """Read every file a serving process reads at start-up (API keys, certificates), so
    that a supervisor reports a bad one in one line before it starts any process."""
    if config.auth.api_keys_file:
        ApiKeys.load(config.auth.api_keys_file)
    if config.tls.enabled:
        CertificateFiles(config.tls)
    if config.picker.enabled and config.picker.tls.enabled:
        CertificateFiles(config.picker.tls)
    if any(spec.tls for spec in config.workers):
        channel_credentials(config.upstream_tls)


def ready_line(
    config: GatewayConfig, port: int, admin_port: int, metrics_port: int, picker_port: int = 0
) -> str:
    """`READY host:port admin=host:port [metrics=host:port] [picker=host:port]`: what
    scripts wait for."""
    host = config.listen.rpartition(":")[0]
    admin_host = config.admin.listen.rpartition(":")[0]
    line = f"READY {host}:{port} admin={admin_host}:{admin_port}"
    if metrics_port and config.metrics.listen:
        line += f" metrics={config.metrics.listen.rpartition(':')[0]}:{metrics_port}"
    if picker_port and config.picker.listen:
        line += f" picker={config.picker.listen.rpartition(':')[0]}:{picker_port}"
    return line


WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "localhost"})


def relay_address(config: GatewayConfig, port: int) -> str:
    """Where Envoy reaches the relay (`picker.relay_address`, else the main port's
    address, a wildcard or `localhost` read as 127.0.0.1)."""
    if config.picker.relay_address:
        return config.picker.relay_address
    host = config.listen.rpartition(":")[0]
    return f"{'127.0.0.1' if host in WILDCARDS else host}:{port}"


class Gateway:
    """One serving process: alone, or process `member.index` of `--processes N` (then its
    admin and peer services listen on its private control socket, and the supervisor holds
    the admin port and the metrics endpoint)."""

    def __init__(
        self,
        config: GatewayConfig,
        member: Member | None = None,
        discovered: Mapping[str, Sequence[Discovered]] | None = None,
    ) -> None:
        self.config = config
        self.member = member
        # The engine protocols, built once here and handed to whatever needs one.
        self.adapters = adapters = engine_adapters()
        self.fleet = Fleet(config, adapters, build_policy)
        # Discovery: alone, this process runs the sources; one of --processes N applies
        # what the supervisor's sources found (`discovered` at start, then peer calls).
        self.membership = Membership(
            self.fleet, config.drain.worker_timeout_s, grace_by_source(config.discovery)
        )
        # A long prompt's decoding and hashing, and a discovery file's parsing.
        self.offload = Offload()
        self.sources: Sources | None = None
        if member is None and config.discovery:
            self.sources = Sources(config.discovery, self.offload)
        self._discovered = dict(discovered or {})
        self.inflight = InflightTable()
        self.affinity = Affinity(config.affinity) if config.affinity.enabled else None
        self._declared = declared_models(config)
        self.placer = Placer(
            self.fleet.registry,
            config.model,
            config.retry_after_ms,
            config.loads.interval_s,
            config.loads.stale_after_s,
            adapters,
            self.affinity,
            config.lora,
            self.fleet.lora_watch,
            self._declared,
        )
        served = served_models(config)  # model aliases: changed by the admin API only
        self.routes = RouteTable(
            routes_of(config.models), named_models(config.models, served), served
        )
        upstream = config.upstream
        relay = MetadataRelay(
            upstream.max_relayed_metadata_bytes, upstream.max_relayed_metadata_entries
        )
        self.upstreams = Upstreams(self.fleet, self.inflight, config.disagg.abort_wait_s, relay)
        self.rooms: WaitingRooms | None = None
        if config.flow is not None:
            self.rooms = WaitingRooms(
                config.flow,
                config.tenant,
                self.upstreams,
                config.retry_after_ms,
            )
        self.rates = rate_limits(config)
        self.migrations = Migrations(config.migration, config.limits.max_prompt_tokens)
        # LoRA adapters loaded on demand (`lora.adapters`): before a call's legs open.
        self.loras = LoraLoader(config.lora, self.fleet) if config.lora.enabled else None
        self.dispatcher = Dispatcher(
            self.upstreams,
            config.max_attempts,
            self.migrations,
            self.loras,
            config.retry_after_ms,
        )
        limits = config.limits
        self.admission = Admission(limits.max_inflight_requests, limits.principal_share)
        self.trimmer = Trimmer(lambda: self.admission.active, self.offload)
        self.reads = ReadGate(limits.max_request_reads, limits.max_request_reads_per_peer)
        self.idle = IdleWatch(limits.stream_idle_timeout_s)
        decode_first_within_s = config.disagg.decode_first_message_timeout_s
        if member is None:
            self.disagg = DisaggregatedDispatch(self.dispatcher, None, decode_first_within_s)
            self.siblings: Siblings | None = None
        else:
            pd_rooms = BootstrapRooms(
                index=member.index, count=member.count
            )  # SGLang bootstrap rooms
            self.disagg = DisaggregatedDispatch(self.dispatcher, pd_rooms, decode_first_within_s)
            self.siblings = Siblings(member.siblings())
        self.tracing: Tracing | None = None
        if tracing_enabled(config.tracing):
            process = str(member.index) if member is not None else ""
            self.tracing = Tracing(config.tracing, process=process)
        tenant_labels = config.flow.tenant_labels if config.flow else DEFAULT_TENANT_LABELS
        self.metrics = Metrics(self.fleet.registry, kv=self.fleet, tenant_labels=tenant_labels)
        if self.rooms is not None:
            self.metrics.flow(self.rooms)
        if self.tracing is not None:
            self.metrics.tracing(self.tracing.counts)
        if self.affinity is not None:
            self.metrics.affinity(self.affinity)
        if self.loras is not None:
            self.metrics.lora(self.loras, self.fleet.registry)
        self.metrics.migration(self.migrations.budget, UNFOLLOWED)
        self.metrics.relayed_metadata(lambda: relay.dropped)
        self.auth = ApiKeyAuth.from_config(config.auth, count=self.metrics.auth_failure)
        self.certificates = CertificateFiles(config.tls) if config.tls.enabled else None
        # The picker port's: its own, else the main port's same files.
        self.picker_certificates = self.certificates
        if config.picker.enabled and config.picker.tls.enabled:
            self.picker_certificates = CertificateFiles(config.picker.tls)
        self.identities = Identities(self.auth, certificates=config.tls.client_ca is not None)
        # This process's own load (ORCA), on trailers and StreamCoreMetrics streams.
        self.reporter = OrcaReporter(self.admission, self.rooms, usable_cores())
        self.orca = OrcaService(
            self.reporter, config.orca, self.identities, refused=self.metrics.orca_refused
        )
        if any(spec.tls for spec in config.workers):
            self.fleet.upstream_credentials()  # unreadable files stop start-up, not a join
        self.health = HealthService(
            max_watches=limits.max_concurrent_streams * 4,
            guard=self.auth.require if self.auth is not None else None,
        )
        self.draining = False
        self._health_due = False
        self._closed = False
        self.server = aio.server(
            # The engine fronts authenticate their calls themselves, from the metadata
            # they read once; the interceptor guards everything else on the port.
            interceptors=[self.auth.interceptor(self._front_prefixes())]
            if self.auth is not None
            else None,
            options=server_options(config, shared=member is not None),
        )
        # The endpoint picker's port (`picker.listen`), with the same transport limits.
        self.picker_server: aio.Server | None = None
        if config.picker.enabled:
            self.picker_server = aio.server(
                options=picker_options(config, shared=member is not None)
            )
        self.picker_port = 0
        self.admin_server: aio.Server | None = None
        self.admin: AdminService | None = None
        self.connections: ConnectionWatch | None = None
        self.fronts: list[EngineFront] = []
        self.port = self.admin_port = self.metrics_port = 0

    def _observe(self, record: CallRecord) -> None:
        """An engine call ended: counted in the metrics and in the load reports."""
        self.metrics.observe(record)
        self.reporter.observe(record)

    def _front_prefixes(self) -> tuple[str, ...]:
        return tuple(f"/{a.service_name}/" for a in self.adapters.values())

    async def start(self, drained: Sequence[str] = ()) -> int:
        """Listen and serve; `drained` workers start drained (a restarted serving process
        takes over what the admin API did to its predecessor)."""
        load = self.reporter if self.config.orca.trailers else None
        door = Door(self.identities, self.admission, self.reads, self.idle, self.rates, load)
        routing = Routing(
            self.fleet.registry,
            self.placer,
            self.dispatcher,
            self.disagg,
            self.offload,
            self.rooms,
            self.routes,
        )
        self.fronts = fronts = [
            EngineFront(
                adapter,
                self.config,
                door,
                routing,
                self._observe,
                self.siblings,
                self.tracing,
            )
            for adapter in self.adapters.values()
        ]
        self.server.add_generic_rpc_handlers(
            (*(front.handler() for front in fronts), self.orca.handler())
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [a.service_name for a in self.adapters.values()]
            + [HEALTH_SERVICE, ORCA_SERVICE, reflection.SERVICE_NAME],
            self.server,
        )
        credentials = self.certificates.credentials() if self.certificates else None
        self.port = bind(self.server, self.config.listen, credentials)
        if self.picker_server is not None:
            self._start_picker(fronts)
        raise_fd_limit(self.config.limits.max_connections)
        self.trimmer.start()
        limits = self.config.limits
        self.connections = ConnectionWatch(
            (self.port, self.picker_port) if self.picker_port else (self.port,),
            limits.max_connections,
            limits.max_connections_per_peer,
            report=self.metrics.connections,
        )
        # Capacity events (every request's end) only for the waiting rooms.
        kinds = EVERY if self.rooms is not None else CHANGES
        self.fleet.registry.subscribe(self._on_fleet_event, kinds)
        self.routes.subscribe(self._refresh_health)
        self.fleet.registry.subscribe(self.upstreams.on_fleet_event)
        self._refresh_health()
        await self.fleet.start(self.config.workers)
        await self._discover()
        for worker_id in drained:
            worker = self.fleet.registry.get(worker_id)
            if worker is not None:
                await self.fleet.drain(worker, 0.0)
        peer = None
        if self.member is not None:
            by_service = {front.adapter.service_name: front for front in self.fronts}
            peer = PeerService(by_service, self.metrics.prometheus, self.membership)
        affinity = self.placer.affinity
        sessions = (lambda: len(affinity.table)) if affinity is not None else None
        self.admin_server, self.admin_port, self.admin = await start_admin_server(
            self.fleet, self.config, peer, self.rooms, self.routes, sessions
        )
        if self.config.metrics.listen:
            try:
                self.metrics_port = self.metrics.serve(self.config.metrics.listen)
            except OSError as exc:
                raise CannotListen(self.config.metrics.listen, exc.strerror or str(exc)) from None
        await self.server.start()
        if self.picker_server is not None:
            await self.picker_server.start()
        self.connections.start()
        if self.auth is not None:
            self.auth.start()
        # One of --processes N answers the supervisor on its control socket: the admin
        # port is the supervisor's, and so is the metrics endpoint.
        admin = (
            {"admin_port": self.admin_port}
            if self.member is None
            else {"control": self.config.admin.listen}
        )
        log.info(
            "serving",
            listen=self.config.listen,
            port=self.port,
            **admin,
            metrics_port=self.metrics_port or None,
            workers=len(self.fleet.registry),
        )
        self._warn_unservable()
        return self.port

    def _start_picker(self, fronts: list[EngineFront]) -> None:
        """The endpoint picker on its own port, with the gateway's health service (what
        Envoy health-checks), naming this process's relay for the calls it cannot place."""
        assert self.picker_server is not None and self.config.picker.listen is not None
        relay = relay_address(self.config, self.port)
        # Its failed authentications block an address on the picker port only.
        identities = Identities(
            self.auth.at_door("picker") if self.auth is not None else None,
            certificates=self.config.tls.client_ca is not None,
        )
        picker = Picker(fronts, self.config, relay, self.metrics.picker_answer, identities)
        self.picker_server.add_generic_rpc_handlers((picker.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.picker_server)
        files = self.picker_certificates
        credentials = files.credentials() if files is not None else None
        self.picker_port = bind(self.picker_server, self.config.picker.listen, credentials)

    def _warn_unservable(self) -> None:
        """READY with no usable worker for a model is worth a warning an operator can
        alert on (the model's health entry says NOT_SERVING too): no worker configured, a
        model named in `models:` with none, every probe failing. Said once, at start-up,
        by the process alone or the first of several (they see the same fleet); worker
        statuses tell the rest."""
        if self.member is not None and self.member.index != 0:
            return
        registry = self.fleet.registry
        models = sorted(
            set(registry.models()) | set(self.config.models) - set(self.routes.routes())
        )
        unusable = [model for model in models if not self.placer.servable(model)]
        if unusable or not len(registry):
            log.warning(
                "no_usable_workers",
                models=unusable,
                workers=len(registry),
                note="their calls are refused until a worker is ready",
            )

    async def _discover(self) -> None:
        """Start-up waits (bounded by discovery_timeout_s) until every source answered
        once and the hosts it named have a first probe verdict."""
        membership = self.membership
        for source, hosts in self._discovered.items():
            membership.apply(source, hosts)
        names = list(self._discovered)
        if self.sources is not None:
            self.sources.start(membership.apply)
            self.metrics.discovery(lambda: self.sources.stats if self.sources else [])
            names += self.sources.names
        if names and not await membership.first_reports(names, self.config.discovery_timeout_s):
            log.warning(
                "discovery_incomplete",
                waited_s=self.config.discovery_timeout_s,
                note="serving; hosts join as their sources answer",
            )

    def reload(self) -> None:
        """SIGHUP: read the certificate files again (when serving TLS); logged either way."""
        for files in {self.certificates, self.picker_certificates} - {None}:
            assert files is not None
            files.reload()
        if self.auth is not None:
            self.auth.reload()
        tls = self.certificates is not None or self.picker_certificates is not None
        log.info("reloaded", certificates=tls)

    def ready_line(self) -> str:
        return ready_line(
            self.config, self.port, self.admin_port, self.metrics_port, self.picker_port
        )

    def _on_fleet_event(self, event: FleetEvent) -> None:
        """Recompute health once per burst of events, after the code that changed the
        fleet (often a request's end) has moved on: that code does constant work."""
        if self.rooms is not None and event.kind in ("status", "outlier", "added", "capacity"):
            self.rooms.kick(event.worker.model)  # room, or a worker back: calls may go on
        if event.kind == "capacity":
            return  # health answers do not change with a worker's load
        if self._health_due:
            return
        self._health_due = True
        asyncio.get_running_loop().call_soon(self._refresh_health)

    def _refresh_health(self) -> None:
        self._health_due = False
        registry = self.fleet.registry
        by_runtime = {rt: registry.models(rt) for rt in self.adapters if registry.models(rt)}
        aliases = {alias: self.routes.leaves(alias) for alias in self.routes.routes()}
        self.health.update(
            desired_statuses(
                self.draining,
                by_runtime,
                self.placer.servable,
                self.adapters,
                aliases,
                live=(PICKER_SERVICE,) if self.config.picker.enabled else (),
                declared=self._declared,
            )
        )

    def _servers(self) -> list[aio.Server]:
        """The ports engine calls arrive on: the relay's, and the picker's."""
        return [self.server] + ([self.picker_server] if self.picker_server else [])

    @property
    def busy(self) -> bool:
        """Calls are in flight (the gateway's own count, every protocol)."""
        return self.admission.active > 0

    async def drain_and_stop(self, delay: bool = True) -> None:
        """SIGTERM: NOT_SERVING everywhere at once; keep serving for the drain delay so load
        balancers notice (`delay` False: skip it); then refuse new calls and let in-flight
        ones finish in the grace."""
        drain = self.config.drain
        self.draining = True
        for front in self.fronts:
            front.fleet_calls.drain()
        self._refresh_health()
        delay_s = drain.delay_s if delay else 0.0
        log.info("draining", delay_s=delay_s, grace_s=drain.grace_s)
        await asyncio.sleep(delay_s)
        started = time.monotonic()
        log.info("stopping", in_flight=sum(w.inflight for w in self.fleet.registry))
        self.health.close_watches()
        self.orca.close_streams()
        flush = None
        if self.rooms is not None:  # queued calls keep their place until the grace ends
            rooms = self.rooms
            before_end = max(0.0, drain.grace_s - SHUT_MARGIN_S)
            flush = asyncio.get_running_loop().call_later(before_end, rooms.shut)
        await asyncio.gather(*(s.stop(drain.grace_s) for s in self._servers()))
        if flush is not None:
            flush.cancel()
        log.info("stopped", waited_s=round(time.monotonic() - started, 3))
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.connections is not None:
            await self.connections.stop()
        if self.auth is not None:
            await self.auth.stop()
        for server in self._servers():
            await server.stop(None)
        self.idle.close()
        if self.admin_server is not None:
            await self.admin_server.stop(ADMIN_STOP_GRACE_S)
        if self.admin is not None:
            await self.admin.close()
        if self.siblings is not None:
            await self.siblings.close()
        self.metrics.close()
        if self.sources is not None:  # before the offload thread they parse in
            await self.sources.close()
        await self.trimmer.stop()  # it trims in the offload thread too
        self.offload.close()
        if self.tracing is not None:  # bounded: a collector that is down holds up nothing
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.close)
        await self.membership.close()
        await self.upstreams.close()  # the upstream calls' tasks, before their channels
        if self.loras is not None:
            await self.loras.close()  # on-demand adapter loads, before their channels
        await self.fleet.close()


async def serve(
    config: GatewayConfig,
    member: Member | None = None,
    drained: Sequence[str] = (),
    discovered: Mapping[str, Sequence[Discovered]] | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then drain. A signal during start-up stops at once;
    SIGINT with nothing in flight skips the drain delay (someone at a terminal, no load
    balancer to tell); a second signal stops at once, whatever is in flight."""
    gateway = Gateway(config, member, discovered)
    loop = asyncio.get_running_loop()
    signals: list[signal.Signals] = []
    stopped = asyncio.Event()
    main = asyncio.current_task()
    assert main is not None

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        stopped.set()
        if len(signals) > 1:
            main.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    # SIGHUP reloads what can be reloaded, in every mode: its default action would end
    # the process and every stream it serves.
    loop.add_signal_handler(signal.SIGHUP, gateway.reload)
    try:
        async with TaskScope(log_failures=False) as scope:  # start-up's error: raised here
            starting = scope.spawn(gateway.start(drained), "gateway_start")
            waiting = scope.spawn(stopped.wait(), "stop_signal")
            await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                log.info("stopping during start-up", signal=signals[0].name)
                return  # leaving the scope cancels the start-up and waits for it
            starting.result()  # CannotListen and friends
            print(gateway.ready_line(), flush=True)
            await waiting
        quick = signals[0] is signal.SIGINT and not gateway.busy
        await gateway.drain_and_stop(delay=not quick)
    except asyncio.CancelledError:
        if len(signals) < 2:
            raise
        log.warning("stopping now: second signal")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await gateway.close()


def rate_limits(config: GatewayConfig) -> RateLimits | None:
    """Tenants' rate limits, if any tenant (or `default`) has one."""
    if not any(t.requests_per_minute or t.tokens_per_minute for t in config.tenants.values()):
        return None

    def limits(tenant: str) -> tuple[int | None, int | None]:
        found = config.tenant(tenant)
        return found.requests_per_minute, found.tokens_per_minute

    return RateLimits(limits)
