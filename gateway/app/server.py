"""The lifecycle of one serving process: bind its ports, start what `assemble` built,
serve until SIGTERM, drain, and stop everything in order. The parts themselves are built
in app/assembly.py."""

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
from gateway.app.assembly import assemble, relay_address
from gateway.app.connections import ConnectionWatch, raise_fd_limit
from gateway.app.reload import Reloader, Reread
from gateway.app.transport import picker_options, server_options
from gateway.config import GatewayConfig
from gateway.config.reload import Reload
from gateway.core.listen import CannotListen, bind
from gateway.core.member import Member
from gateway.core.tasks import TaskScope
from gateway.discovery.source import Discovered
from gateway.orca.service import SERVICE_NAME as ORCA_SERVICE
from gateway.peer.service import PeerService
from gateway.picker.service import SERVICE as PICKER_SERVICE
from gateway.picker.service import Picker
from gateway.security.identity import Identities
from gateway.services.health import desired_statuses
from gateway.upstream.registry import CHANGES, EVERY, FleetEvent

log = structlog.get_logger("gateway")

HEALTH_SERVICE = "grpc.health.v1.Health"
ADMIN_STOP_GRACE_S = 0.2  # a graceful GOAWAY: control channels close without an error
SHUT_MARGIN_S = 0.25  # calls still queued this long before the grace ends are answered


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


class Gateway:
    """One serving process: alone, or process `member.index` of `--processes N` (then its
    admin and peer services listen on its private control socket, and the supervisor holds
    the admin port and the metrics endpoint)."""

    def __init__(
        self,
        config: GatewayConfig,
        member: Member | None = None,
        discovered: Mapping[str, Sequence[Discovered]] | None = None,
        reread: Reread | None = None,
    ) -> None:
        self.member = member
        self.parts = parts = assemble(config, member, discovered)
        # SIGHUP (and `--watch-config`): `reread` reads the config file again.
        self.reloader = Reloader(lambda: parts.config, reread, self._reloaded)
        self.draining = False
        self._health_due = False
        self._closed = False
        auth = parts.auth
        self.server = aio.server(
            # The engine fronts authenticate their calls themselves, from the metadata
            # they read once; the interceptor guards everything else on the port.
            interceptors=[auth.interceptor(parts.front_prefixes())] if auth is not None else None,
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
        self.port = self.admin_port = self.metrics_port = 0

    async def start(self, drained: Sequence[str] = ()) -> int:
        """Listen and serve; `drained` workers start drained (a restarted serving process
        takes over what the admin API did to its predecessor)."""
        parts = self.parts
        self.server.add_generic_rpc_handlers(
            (*(front.handler() for front in parts.fronts), parts.orca.handler())
        )
        health_pb2_grpc.add_HealthServicer_to_server(parts.health, self.server)
        reflection.enable_server_reflection(
            [a.service_name for a in parts.adapters.values()]
            + [HEALTH_SERVICE, ORCA_SERVICE, reflection.SERVICE_NAME],
            self.server,
        )
        credentials = parts.certificates.credentials() if parts.certificates else None
        self.port = bind(self.server, self.config.listen, credentials)
        if self.picker_server is not None:
            self._start_picker()
        raise_fd_limit(self.config.limits.max_connections)
        parts.trimmer.start()
        limits = self.config.limits
        self.connections = ConnectionWatch(
            (self.port, self.picker_port) if self.picker_port else (self.port,),
            limits.max_connections,
            limits.max_connections_per_peer,
            report=parts.metrics.connections,
        )
        # Capacity events (every request's end) only for the waiting rooms.
        kinds = EVERY if parts.rooms is not None else CHANGES
        parts.fleet.registry.subscribe(self._on_fleet_event, kinds)
        parts.routes.subscribe(self._refresh_health)
        parts.fleet.registry.subscribe(parts.upstreams.on_fleet_event)
        self._refresh_health()
        if parts.store is not None:  # the store's routes win over the file's (state.md)
            if parts.assumptions is not None and not await parts.assumptions.agree():
                log.warning("kv_keys_not_shared", note="the store did not answer in time")
            await parts.route_writer.read()
            parts.store.spawn(parts.route_writer.follow(), "routes_follow")
            if parts.assumptions is not None:
                parts.store.spawn(parts.assumptions.publish(), "kv_share_publish")
                parts.store.spawn(parts.assumptions.follow(), "kv_share_follow")
        await parts.fleet.start(self.config.workers)
        await self._discover()
        for worker_id in drained:
            worker = parts.fleet.registry.get(worker_id)
            if worker is not None:
                await parts.fleet.drain(worker, 0.0)
        peer = None
        if self.member is not None:
            by_service = {front.adapter.service_name: front for front in parts.fronts}
            peer = PeerService(by_service, parts.metrics.prometheus, parts.membership)
        affinity = parts.placer.affinity
        sessions = (lambda: len(affinity.table)) if affinity is not None else None
        self.admin_server, self.admin_port, self.admin = await start_admin_server(
            parts.fleet, self.config, peer, parts.rooms, parts.route_writer, sessions
        )
        if self.config.metrics.listen:
            try:
                self.metrics_port = parts.metrics.serve(self.config.metrics.listen)
            except OSError as exc:
                raise CannotListen(self.config.metrics.listen, exc.strerror or str(exc)) from None
        await self.server.start()
        if self.picker_server is not None:
            await self.picker_server.start()
        self.connections.start()
        if parts.auth is not None:
            parts.auth.start()
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
            workers=len(parts.fleet.registry),
        )
        self._warn_unservable()
        return self.port

    def _start_picker(self) -> None:
        """The endpoint picker on its own port, with the gateway's health service (what
        Envoy health-checks), naming this process's relay for the calls it cannot place."""
        parts = self.parts
        assert self.picker_server is not None and self.config.picker.listen is not None
        relay = relay_address(self.config, self.port)
        # Its failed authentications block an address on the picker port only.
        identities = Identities(
            parts.auth.for_port("picker") if parts.auth is not None else None,
            certificates=self.config.tls.client_ca is not None,
        )
        picker = Picker(parts.fronts, self.config, relay, parts.metrics.picker_answer, identities)
        self.picker_server.add_generic_rpc_handlers((picker.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(parts.health, self.picker_server)
        files = parts.picker_certificates
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
        registry = self.parts.fleet.registry
        models = sorted(
            set(registry.models()) | set(self.config.models) - set(self.parts.routes.routes())
        )
        unusable = [model for model in models if not self.parts.placer.servable(model)]
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
        membership = self.parts.membership
        for source, hosts in self.parts.discovered.items():
            membership.apply(source, hosts)
        names = list(self.parts.discovered)
        sources = self.parts.sources
        if sources is not None:
            sources.start(membership.apply)
            self.parts.metrics.discovery(lambda: sources.stats)
            names += sources.names
        if names and not await membership.first_reports(names, self.config.discovery_timeout_s):
            log.warning(
                "discovery_incomplete",
                waited_s=self.config.discovery_timeout_s,
                note="serving; hosts join as their sources answer",
            )

    @property
    def config(self) -> GatewayConfig:
        """The config in force (a reload replaces its keys that reload)."""
        return self.parts.config

    def reload(self) -> None:
        """SIGHUP: the certificate and key files, and the config file, read again."""
        self.reloader.request()

    def _reloaded(self, done: Reload | None) -> None:
        """A reload read (or not: `done` None): the files read again, its config put in
        force; logged either way."""
        parts = self.parts
        for files in {parts.certificates, parts.picker_certificates} - {None}:
            assert files is not None
            files.reload()
        if parts.auth is not None:
            parts.auth.reload()
        tls = parts.certificates is not None or parts.picker_certificates is not None
        fields: dict[str, object] = {}
        if done is not None:
            fields["applied"] = list(done.applied)
            if done.applied:
                changed = parts.configure(done.config)
                fields.update(policies=changed.policies, routes=changed.routes)
                self._refresh_health()  # declared models and routes may differ
                if parts.rooms is not None:  # raised bounds: waiting calls may go on
                    for model in parts.fleet.registry.models():
                        parts.rooms.kick(model)
        log.info("reloaded", certificates=tls, **fields)

    def ready_line(self) -> str:
        return ready_line(
            self.config, self.port, self.admin_port, self.metrics_port, self.picker_port
        )

    def _on_fleet_event(self, event: FleetEvent) -> None:
        """Recompute health once per burst of events, after the code that changed the
        fleet (often a request's end) has moved on: that code does constant work."""
        rooms = self.parts.rooms
        if rooms is not None and event.kind in ("status", "outlier", "added", "capacity"):
            rooms.kick(event.worker.model)  # room, or a worker back: calls may go on
        if event.kind == "capacity":
            return  # health answers do not change with a worker's load
        if self._health_due:
            return
        self._health_due = True
        asyncio.get_running_loop().call_soon(self._refresh_health)

    def _refresh_health(self) -> None:
        self._health_due = False
        parts = self.parts
        registry = parts.fleet.registry
        by_runtime = {rt: registry.models(rt) for rt in parts.adapters if registry.models(rt)}
        aliases = {alias: parts.routes.leaves(alias) for alias in parts.routes.routes()}
        parts.health.update(
            desired_statuses(
                self.draining,
                by_runtime,
                parts.placer.servable,
                parts.adapters,
                aliases,
                live=(PICKER_SERVICE,) if self.config.picker.enabled else (),
                declared=parts.declared,
            )
        )

    def _servers(self) -> list[aio.Server]:
        """The ports engine calls arrive on: the relay's, and the picker's."""
        return [self.server] + ([self.picker_server] if self.picker_server else [])

    @property
    def busy(self) -> bool:
        """Calls are in flight (the gateway's own count, every protocol)."""
        return self.parts.admission.active > 0

    async def drain_and_stop(self, delay: bool = True) -> None:
        """SIGTERM: NOT_SERVING everywhere at once; keep serving for the drain delay so load
        balancers notice (`delay` False: skip it); then refuse new calls and let in-flight
        ones finish in the grace."""
        drain = self.config.drain
        self.draining = True
        for front in self.parts.fronts:
            front.fleet_calls.drain()
        self._refresh_health()
        delay_s = drain.delay_s if delay else 0.0
        log.info("draining", delay_s=delay_s, grace_s=drain.grace_s)
        await asyncio.sleep(delay_s)
        started = time.monotonic()
        log.info("stopping", in_flight=sum(w.inflight for w in self.parts.fleet.registry))
        self.parts.health.close_watches()
        self.parts.orca.close_streams()
        flush = None
        if self.parts.rooms is not None:  # queued calls keep their place until the grace ends
            rooms = self.parts.rooms
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
        parts = self.parts
        await self.reloader.close()
        if self.connections is not None:
            await self.connections.stop()
        if parts.auth is not None:
            await parts.auth.stop()
        for server in self._servers():
            await server.stop(None)
        parts.idle.close()
        if self.admin_server is not None:
            await self.admin_server.stop(ADMIN_STOP_GRACE_S)
        if self.admin is not None:
            await self.admin.close()
        if parts.siblings is not None:
            await parts.siblings.close()
        parts.metrics.close()
        if parts.sources is not None:  # before the offload thread they parse in
            await parts.sources.close()
        await parts.trimmer.stop()  # it trims in the offload thread too
        parts.offload.close()
        if parts.tracing is not None:  # bounded: a collector that is down holds up nothing
            await asyncio.get_running_loop().run_in_executor(None, parts.tracing.close)
        await parts.membership.close()
        if parts.store is not None:  # its writes in flight end with it
            await parts.store.close()
        await parts.upstreams.close()  # the upstream calls' tasks, before their channels
        if parts.loras is not None:
            await parts.loras.close()  # on-demand adapter loads, before their channels
        await parts.fleet.close()


async def serve(
    config: GatewayConfig,
    member: Member | None = None,
    drained: Sequence[str] = (),
    discovered: Mapping[str, Sequence[Discovered]] | None = None,
    reread: Reread | None = None,
    watch: str | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then drain. A signal during start-up stops at once;
    SIGINT with nothing in flight skips the drain delay (someone at a terminal, no load
    balancer to tell); a second signal stops at once, whatever is in flight. SIGHUP reads
    the config again with `reread`; `watch`: the file whose changes do too."""
    gateway = Gateway(config, member, discovered, reread)
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
            if watch is not None:
                gateway.reloader.spawn_watch(watch)
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
