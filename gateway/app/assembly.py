"""The object graph of one serving process, built from its config and nothing else: the
fleet, placement, dispatch, the call's door and routing, the engine fronts, and what
observes them. Nothing here listens, starts a task or touches the network; the lifecycle
(app/server.py) binds the ports, starts and stops what this returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.app.memory import Trimmer
from gateway.app.metrics import Metrics
from gateway.config import (
    DEFAULT_TENANT_LABELS,
    Declared,
    GatewayConfig,
    declared_models,
    route_targets,
    routes_of,
    usable_cores,
)
from gateway.core.current import Current
from gateway.core.member import Member
from gateway.core.offload import Offload
from gateway.discovery.membership import Membership
from gateway.discovery.runner import Sources, grace_by_source
from gateway.discovery.source import Discovered
from gateway.engines import Adapters, engine_adapters
from gateway.observability.record import CallRecord
from gateway.observability.tracing import Tracing
from gateway.observability.tracing import enabled as tracing_enabled
from gateway.orca.report import OrcaReporter
from gateway.orca.service import OrcaService
from gateway.peer.client import Siblings
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
    EngineFront,
    Entrance,
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
from gateway.services.health import HealthService
from gateway.state.assumptions import SharedAssumptions
from gateway.state.budgets import TenantBudgets
from gateway.state.routes import RouteWriter
from gateway.state.sessions import SharedSessions
from gateway.state.store import Store
from gateway.upstream.latency import learn, lessons
from gateway.upstream.manager import Fleet


@dataclass(eq=False)
class Parts:
    """What one serving process is made of. Built once by `assemble`; each part's own
    state has its own writer, and the lifecycle only starts and stops them."""

    current: Current[GatewayConfig]  # the config in force: `configure` replaces it
    member: Member | None
    adapters: Adapters
    fleet: Fleet
    membership: Membership
    offload: Offload
    sources: Sources | None
    discovered: dict[str, Sequence[Discovered]]
    inflight: InflightTable
    declared: Declared
    placer: Placer
    routes: RouteTable
    route_writer: RouteWriter
    store: Store | None
    sessions: SharedSessions | None
    assumptions: SharedAssumptions | None
    budgets: TenantBudgets
    upstreams: Upstreams
    rooms: WaitingRooms | None
    migrations: Migrations
    loras: LoraLoader | None
    dispatcher: Dispatcher
    disagg: DisaggregatedDispatch
    siblings: Siblings | None
    admission: Admission
    trimmer: Trimmer
    idle: IdleWatch
    tracing: Tracing | None
    metrics: Metrics
    auth: ApiKeyAuth | None
    certificates: CertificateFiles | None
    picker_certificates: CertificateFiles | None
    identities: Identities
    reporter: OrcaReporter
    orca: OrcaService
    health: HealthService
    fronts: list[EngineFront] = field(default_factory=list)

    @property
    def config(self) -> GatewayConfig:
        return self.current.value

    def configure(self, config: GatewayConfig) -> Reconfigured:
        """A reload's config put in force (`gateway.config.reload`: only keys that reload
        differ from the running one): every part that keeps a setting of its own takes
        its new value; the stages read the rest from `current` at each call. Calls in
        flight finish as they started."""
        before, self.current.value = self.config, config
        policies = self.fleet.configure(config)
        self.declared = declared_models(config)
        self.placer.configure(config.model, config.retry_after_ms, config.lora, self.declared)
        routes = self.route_writer.configure(
            routes_of(before.models), routes_of(config.models), *route_targets(config)
        )
        if self.rooms is not None and config.flow is not None:
            self.rooms.configure(config.flow, config.retry_after_ms)
        self.dispatcher.configure(config.max_attempts, config.retry_after_ms)
        limits = config.limits
        self.migrations.configure(config.migration, limits.max_prompt_tokens)
        if self.loras is not None:
            self.loras.configure(config.lora)
        self.admission.configure(limits.max_inflight_requests, limits.principal_share)
        self.idle.configure(limits.stream_idle_timeout_s)
        if self.placer.affinity is not None:
            self.placer.affinity.configure(config.affinity)
        if self.sessions is not None:
            self.sessions.configure(config.affinity.ttl_s)
        self.budgets.active = has_rates(config)
        return Reconfigured(policies, routes)

    def observe(self, record: CallRecord) -> None:
        """An engine call ended: counted in the metrics and in the load reports, and
        learned from by its worker's latency model."""
        self.metrics.observe(record)
        self.reporter.observe(record)
        for taught in lessons(record):
            worker = self.fleet.registry.get(taught.worker)
            if worker is not None:
                learn(worker.latency, taught)

    def front_prefixes(self) -> tuple[str, ...]:
        """The engine services' method prefixes (`/sglang.runtime.v1.SglangScheduler/`)."""
        return tuple(f"/{a.service_name}/" for a in self.adapters.values())


@dataclass(frozen=True, slots=True)
class Reconfigured:
    """What a reload changed beyond plain settings (for its log line)."""

    policies: list[str]  # models whose policy was replaced
    routes: list[str]  # aliases whose route changed


def assemble(
    config: GatewayConfig,
    member: Member | None = None,
    discovered: Mapping[str, Sequence[Discovered]] | None = None,
) -> Parts:
    """Build the parts of one serving process: alone, or process `member.index` of
    `--processes N` (then discovery is the supervisor's, and `discovered` is what its
    sources found before this process started)."""
    # The engine protocols, built once here and handed to whatever needs one.
    adapters = engine_adapters()
    current = Current(config)  # what the parts read at each use; a reload replaces it
    fleet = Fleet(config, adapters, build_policy)
    membership = Membership(fleet, config.drain.worker_timeout_s, grace_by_source(config.discovery))
    # A long prompt's decoding and hashing, and a discovery file's parsing.
    offload = Offload()
    sources = Sources(config.discovery, offload) if member is None and config.discovery else None
    inflight = InflightTable()
    affinity = Affinity(config.affinity) if config.affinity.enabled else None
    declared = declared_models(config)
    placer = Placer(
        fleet.registry,
        config.model,
        config.retry_after_ms,
        config.loads.interval_s,
        config.loads.stale_after_s,
        adapters,
        affinity,
        config.lora,
        fleet.lora_watch,
        declared,
    )
    # Model aliases: changed by the admin API and reloads only.
    routes = RouteTable(routes_of(config.models), *route_targets(config))
    # What every replica shares, with `state:`: budgets, routes and session bindings.
    store = Store(config.state) if config.state.enabled else None
    sessions = None
    if store is not None and affinity is not None:
        sessions = SharedSessions(affinity, store, config.affinity.ttl_s)
    assumptions = None
    if store is not None:  # what cache-aware placement learns, every gateway alike
        assumptions = SharedAssumptions(
            fleet.kv_index, store, lambda worker: fleet.registry.get(worker) is not None
        )
    upstream = config.upstream
    relay = MetadataRelay(
        upstream.max_relayed_metadata_bytes, upstream.max_relayed_metadata_entries
    )
    upstreams = Upstreams(fleet, inflight, config.disagg.abort_wait_s, relay)
    rooms = None
    if config.flow is not None:
        rooms = WaitingRooms(
            config.flow, lambda t: current.value.tenant(t), upstreams, config.retry_after_ms
        )
    migrations = Migrations(config.migration, config.limits.max_prompt_tokens)
    # LoRA adapters loaded on demand (`lora.adapters`): before a call's legs open.
    loras = LoraLoader(config.lora, fleet) if config.lora.enabled else None
    dispatcher = Dispatcher(
        upstreams, config.max_attempts, migrations, loras, config.retry_after_ms
    )
    decode_first_within_s = config.disagg.decode_first_message_timeout_s
    siblings = None
    pd_rooms = None
    if member is not None:
        pd_rooms = BootstrapRooms(index=member.index, count=member.count)  # SGLang's
        siblings = Siblings(member.siblings())
    disagg = DisaggregatedDispatch(dispatcher, pd_rooms, decode_first_within_s)
    limits = config.limits
    admission = Admission(limits.max_inflight_requests, limits.principal_share)
    tracing = None
    if tracing_enabled(config.tracing):
        process = str(member.index) if member is not None else ""
        tracing = Tracing(config.tracing, process=process)
    metrics = observed(config, fleet, relay, rooms, tracing, affinity, loras, migrations)
    if store is not None:
        metrics.state(store)
    auth = ApiKeyAuth.from_config(config.auth, count=metrics.auth_failure)
    certificates = CertificateFiles(config.tls) if config.tls.enabled else None
    # The picker port's: its own, else the main port's same files.
    picker_certificates = certificates
    if config.picker.enabled and config.picker.tls.enabled:
        picker_certificates = CertificateFiles(config.picker.tls)
    identities = Identities(auth, certificates=config.tls.client_ca is not None)
    # This process's own load (ORCA), on trailers and StreamCoreMetrics streams.
    reporter = OrcaReporter(admission, rooms, usable_cores())
    orca = OrcaService(reporter, config.orca, identities, refused=metrics.orca_refused)
    if any(spec.tls for spec in config.workers):
        fleet.upstream_credentials()  # unreadable files stop start-up, not a join
    health = HealthService(
        max_watches=limits.max_concurrent_streams * 4,
        guard=auth.require if auth is not None else None,
    )
    parts = Parts(
        current=current,
        member=member,
        adapters=adapters,
        fleet=fleet,
        membership=membership,
        offload=offload,
        sources=sources,
        discovered=dict(discovered or {}),
        inflight=inflight,
        declared=declared,
        placer=placer,
        routes=routes,
        route_writer=RouteWriter(routes, store),
        store=store,
        sessions=sessions,
        assumptions=assumptions,
        budgets=budgets(current, store),
        upstreams=upstreams,
        rooms=rooms,
        migrations=migrations,
        loras=loras,
        dispatcher=dispatcher,
        disagg=disagg,
        siblings=siblings,
        admission=admission,
        trimmer=Trimmer(lambda: admission.active, offload),
        idle=IdleWatch(limits.stream_idle_timeout_s),
        tracing=tracing,
        metrics=metrics,
        auth=auth,
        certificates=certificates,
        picker_certificates=picker_certificates,
        identities=identities,
        reporter=reporter,
        orca=orca,
        health=health,
    )
    parts.fronts = fronts(parts)
    return parts


def observed(
    config: GatewayConfig,
    fleet: Fleet,
    relay: MetadataRelay,
    rooms: WaitingRooms | None,
    tracing: Tracing | None,
    affinity: Affinity | None,
    loras: LoraLoader | None,
    migrations: Migrations,
) -> Metrics:
    """The metrics endpoint's collectors, one beside each part that has any."""
    tenant_labels = config.flow.tenant_labels if config.flow else DEFAULT_TENANT_LABELS
    metrics = Metrics(fleet.registry, kv=fleet, tenant_labels=tenant_labels)
    if rooms is not None:
        metrics.flow(rooms)
    if tracing is not None:
        metrics.tracing(tracing.counts)
    if affinity is not None:
        metrics.affinity(affinity)
    if loras is not None:
        metrics.lora(loras, fleet.registry)
    metrics.migration(migrations.budget, UNFOLLOWED)
    metrics.relayed_metadata(lambda: relay.dropped)
    return metrics


def fronts(parts: Parts) -> list[EngineFront]:
    """One engine front per engine protocol, sharing the call's door and routing."""
    config = parts.config
    limits = config.limits
    load = parts.reporter if config.orca.trailers else None
    reads = ReadGate(limits.max_request_reads, limits.max_request_reads_per_peer)
    door = Entrance(parts.identities, parts.admission, reads, parts.idle, parts.budgets, load)
    routing = Routing(
        parts.fleet.registry,
        parts.placer,
        parts.dispatcher,
        parts.disagg,
        parts.offload,
        parts.rooms,
        parts.routes,
        parts.sessions,
    )
    return [
        EngineFront(
            adapter, parts.current, door, routing, parts.observe, parts.siblings, parts.tracing
        )
        for adapter in parts.adapters.values()
    ]


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


def has_rates(config: GatewayConfig) -> bool:
    """Some tenant (or `default`) has a rate limit."""
    return any(t.requests_per_minute or t.tokens_per_minute for t in config.tenants.values())


def budgets(current: Current[GatewayConfig], store: Store | None) -> TenantBudgets:
    """Tenants' rate limits (the tenants in force at each call): in the shared store with
    `state:`, else this process's own; inactive while no tenant has one."""

    def limits(tenant: str) -> tuple[int | None, int | None]:
        found = current.value.tenant(tenant)
        return found.requests_per_minute, found.tokens_per_minute

    rates = TenantBudgets(limits, store)
    rates.active = has_rates(current.value)
    return rates


WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "localhost"})


def relay_address(config: GatewayConfig, port: int) -> str:
    """Where Envoy reaches the relay (`picker.relay_address`, else the main port's
    address, a wildcard or `localhost` read as 127.0.0.1)."""
    if config.picker.relay_address:
        return config.picker.relay_address
    host = config.listen.rpartition(":")[0]
    return f"{'127.0.0.1' if host in WILDCARDS else host}:{port}"
