"""The admin service: add, remove, drain, list and watch workers, and change the model
aliases' splits, on its own port.

It only translates: the fleet does the work, `convert` shapes the answers. Errors are
gRPC statuses a person can act on: a bad URL is INVALID_ARGUMENT with the config error's
one line, a duplicate ALREADY_EXISTS, an unknown worker id NOT_FOUND.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import NoReturn, Protocol, TypeAlias

import grpc
import structlog
from google.protobuf.message import Message
from grpc import aio
from grpc_reflection.v1alpha import reflection

from gateway.admin import convert
from gateway.admin.auth import admin_token_interceptor
from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.config import (
    AdminConfig,
    ConfigError,
    GatewayConfig,
    Route,
    WorkerSpec,
    parse_worker_url,
)
from gateway.core.listen import bind
from gateway.core.tasks import TaskScope
from gateway.peer.service import PeerService, add_peer_service
from gateway.placement.routes import BadRoute, RouteTable, UnknownAlias
from gateway.state.routes import RouteWriter
from gateway.upstream.manager import Fleet, WorkerExists
from gateway.upstream.registry import FleetEvent
from gateway.upstream.worker import Worker, discovered_sources

log = structlog.get_logger("gateway.admin")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["AdminService"].full_name
WATCH_QUEUE_SIZE = 1024  # events a slow watcher may lag behind before it is cut off

Context: TypeAlias = aio.ServicerContext  # grpc ships no type hints: Any to mypy


async def abort(context: Context, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


async def worker_spec(url: str, context: Context) -> WorkerSpec:
    """The worker an AddWorker names; INVALID_ARGUMENT with the config error's line."""
    try:
        return parse_worker_url(url)
    except ConfigError as exc:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


async def require_registered(worker_id: str, registered: bool, context: Context) -> None:
    """INVALID_ARGUMENT for a call that names no worker, NOT_FOUND for an unknown one."""
    if not worker_id:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "worker_id is required")
    if not registered:
        await abort(context, grpc.StatusCode.NOT_FOUND, f"no worker {worker_id!r} is registered")


async def require_removable(worker_id: str, sources: Sequence[str], context: Context) -> None:
    """FAILED_PRECONDITION for a worker a discovery source lists: removed, it would come
    back at the source's next answer (DrainWorker works on any worker)."""
    discovered = discovered_sources(tuple(sources))
    if discovered:
        await abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            f"worker {worker_id} is listed by {', '.join(discovered)}: remove it there "
            "(RemoveWorker would see it come back); DrainWorker stops its new calls",
        )


async def duration_s(request: Message, name: str, default: float, context: Context) -> float:
    """A request's Duration field in seconds (`default` when unset); INVALID_ARGUMENT if
    it is negative."""
    if not request.HasField(name):
        return default
    seconds = float(getattr(request, name).ToTimedelta().total_seconds())
    if seconds < 0:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{name} must not be negative")
    return seconds


class Queues(Protocol):
    """The waiting rooms of flow control, as the admin API shows them."""

    def by_tenant(self) -> dict[tuple[str, str, str], int]: ...


def queues_message(queues: Queues | None) -> pb.ListQueuesResponse:
    """Every (model, class, tenant) with calls waiting, sorted; `enabled` False without
    flow control."""
    if queues is None:
        return pb.ListQueuesResponse(enabled=False)
    depths = sorted(queues.by_tenant().items())
    return pb.ListQueuesResponse(
        enabled=True,
        queues=[pb.QueueDepth(model=m, priority=c, tenant=t, waiting=n) for (m, c, t), n in depths],
    )


def route_message(alias: str, route: Route) -> pb.Route:
    targets = [pb.RouteTarget(model=model, weight=weight) for model, weight in route]
    return pb.Route(alias=alias, targets=targets)


def routes_message(routes: RouteTable) -> pb.ListRoutesResponse:
    return pb.ListRoutesResponse(
        routes=[route_message(alias, route) for alias, route in routes.routes().items()]
    )


async def set_route(routes: RouteWriter, request: pb.SetRouteRequest, context: Context) -> Route:
    """The alias's new route, set; NOT_FOUND for a name that is no alias, INVALID_ARGUMENT
    for a route the config would refuse."""
    route = tuple((t.model, t.weight) for t in request.targets)
    try:
        await routes.set(request.alias, route)
    except UnknownAlias as exc:
        await abort(context, grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
    except BadRoute as exc:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    log.info("admin_set_route", alias=request.alias, route=[f"{m}={w}" for m, w in route])
    return route


class AdminService(admin_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    """AdminService over a running Fleet (and its waiting rooms, with flow control)."""

    def __init__(
        self,
        fleet: Fleet,
        config: GatewayConfig,
        *,
        watch_queue_size: int = WATCH_QUEUE_SIZE,
        queues: Queues | None = None,
        routes: RouteWriter | None = None,
        sessions: Callable[[], int] | None = None,
    ) -> None:
        self._fleet = fleet
        self._sessions = sessions  # session affinity on: how many sessions are bound
        self._routes = routes if routes is not None else RouteWriter(RouteTable({}))
        self._queues = queues
        self._config = config
        self._watch_queue_size = watch_queue_size
        self._removals: dict[str, asyncio.Task[bool]] = {}  # by worker: one removal each
        self._tasks = TaskScope()  # the removals, which outlive the call that asked

    async def close(self) -> None:
        """The gateway stops (after the admin server): a removal still running ends."""
        await self._tasks.close()

    def _message(self, worker: Worker) -> pb.Worker:
        """The worker as the API shows it, with what the prefix index knows of it."""
        fleet = self._fleet
        follower = fleet.followers.get(worker.id)
        kv = pb.KvIndexState(
            blocks=fleet.kv_index.size(worker.id),
            subscription=str(follower.state) if follower is not None else "",
            exact=fleet.kv_index.exact(worker.id),
        )
        return convert.worker_message(worker, kv)

    async def _worker(self, worker_id: str, context: Context) -> Worker:
        worker = self._fleet.registry.get(worker_id)
        await require_registered(worker_id, worker is not None, context)
        assert worker is not None
        return worker

    async def AddWorker(
        self, request: pb.AddWorkerRequest, context: Context
    ) -> pb.AddWorkerResponse:
        spec = await worker_spec(request.url, context)
        timeout = self._config.discovery_timeout_s
        try:
            # Only a URL without model or runtime waits: the fleet asks the worker first.
            async with asyncio.timeout(timeout):
                worker = await self._fleet.add(spec)
        except WorkerExists as exc:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except TimeoutError:
            await abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"worker {spec.address} did not tell its model and runtime within {timeout:g} s;"
                " name both in the URL (?model=...&runtime=...) to register it before it answers",
            )
        return pb.AddWorkerResponse(worker=self._message(worker))

    async def RemoveWorker(
        self, request: pb.RemoveWorkerRequest, context: Context
    ) -> pb.RemoveWorkerResponse:
        worker = await self._worker(request.worker_id, context)
        await require_removable(worker.id, worker.sources, context)
        timeout = await duration_s(
            request, "drain_timeout", self._config.drain.worker_timeout_s, context
        )
        task = self._removals.get(worker.id)
        if task is None:
            log.info("admin_remove_worker", worker=worker.id, drain_timeout_s=timeout)
            removal = self._fleet.remove(worker, timeout)
            task = self._tasks.spawn(removal, "admin_remove_worker", worker=worker.id)
            self._removals[worker.id] = task
            task.add_done_callback(lambda done: self._removal_done(worker.id, done))
        # Shielded: a removal once accepted completes even if the caller goes away.
        drained = await asyncio.shield(task)
        return pb.RemoveWorkerResponse(worker=self._message(worker), drained=drained)

    def _removal_done(self, worker_id: str, task: asyncio.Task[bool]) -> None:
        if self._removals.get(worker_id) is task:
            del self._removals[worker_id]

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, context: Context
    ) -> pb.DrainWorkerResponse:
        worker = await self._worker(request.worker_id, context)
        wait = await duration_s(request, "wait", 0.0, context)
        log.info("admin_drain_worker", worker=worker.id, wait_s=wait)
        drained = await self._fleet.drain(worker, wait)
        return pb.DrainWorkerResponse(worker=self._message(worker), drained=drained)

    async def ResumeWorker(
        self, request: pb.ResumeWorkerRequest, context: Context
    ) -> pb.ResumeWorkerResponse:
        worker = await self._worker(request.worker_id, context)
        if not self._fleet.resume(worker):
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {worker.id} is being removed: add it again once it is gone",
            )
        log.info("admin_resume_worker", worker=worker.id)
        return pb.ResumeWorkerResponse(worker=self._message(worker))

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: Context
    ) -> pb.ListWorkersResponse:
        registry = self._fleet.registry
        listed = [self._message(w) for w in sorted(registry, key=lambda w: w.id)]
        listed += [convert.unidentified_message(entry) for entry in registry.unidentified()]
        sessions = self._sessions() if self._sessions is not None else 0
        return pb.ListWorkersResponse(workers=listed, sessions=sessions)

    async def ListQueues(
        self, request: pb.ListQueuesRequest, context: Context
    ) -> pb.ListQueuesResponse:
        return queues_message(self._queues)

    async def ListRoutes(
        self, request: pb.ListRoutesRequest, context: Context
    ) -> pb.ListRoutesResponse:
        return routes_message(self._routes.table)

    async def SetRoute(self, request: pb.SetRouteRequest, context: Context) -> pb.SetRouteResponse:
        route = await set_route(self._routes, request, context)
        return pb.SetRouteResponse(route=route_message(request.alias, route))

    async def WatchWorkers(
        self, request: pb.WatchWorkersRequest, context: Context
    ) -> AsyncIterator[pb.WatchWorkersResponse]:
        """Snapshot, then every fleet event; the listener only copies and enqueues, never
        waits, since the fleet calls it synchronously in the middle of its updates."""
        registry = self._fleet.registry
        queue: asyncio.Queue[pb.WatchWorkersResponse] = asyncio.Queue(self._watch_queue_size)
        overflowed = False

        def listener(event: FleetEvent) -> None:
            nonlocal overflowed
            try:
                queue.put_nowait(convert.fleet_event(event))
            except asyncio.QueueFull:
                overflowed = True
                registry.unsubscribe(listener)

        # Subscribe and copy the snapshot in one step (no await between): no event is lost
        # or reported twice.
        registry.subscribe(listener)
        try:
            snapshot = [convert.snapshot_event(w) for w in sorted(registry, key=lambda w: w.id)]
            for message in snapshot:
                yield message
            while True:
                if overflowed and queue.empty():
                    await abort(
                        context,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this watcher fell more than {self._watch_queue_size} events behind;"
                        " watch again for a fresh snapshot",
                    )
                yield await queue.get()
        finally:
            registry.unsubscribe(listener)


async def start_admin_server(
    fleet: Fleet,
    config: GatewayConfig,
    peer: PeerService | None = None,
    queues: Queues | None = None,
    routes: RouteWriter | None = None,
    sessions: Callable[[], int] | None = None,
) -> tuple[aio.Server, int, AdminService]:
    """Serve AdminService over `fleet` (and `queues`, `routes`, the count of `sessions`)
    on `config.admin.listen`, with the `peer` service of a serving process beside it (see
    `serve_admin`); the service is closed after the server stops."""
    service = AdminService(fleet, config, queues=queues, routes=routes, sessions=sessions)
    server, port = await serve_admin(service, config.admin, peer)
    return server, port, service


async def serve_admin(
    servicer: admin_pb2_grpc.AdminServiceServicer,
    admin: AdminConfig,
    peer: PeerService | None = None,
) -> tuple[aio.Server, int]:
    """Serve an AdminService (and reflection for it) on `admin.listen`, behind its token;
    returns the started server and its bound port (the listen port may be 0). Raises
    CannotListen if the address cannot be bound."""
    token = admin.token
    server = aio.server(
        interceptors=[admin_token_interceptor(token)] if token else None,
        options=[("grpc.so_reuseport", 0)],
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
    if peer is not None:
        add_peer_service(server, peer)
    reflection.enable_server_reflection([SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = bind(server, admin.listen)
    await server.start()
    return server, port


__all__ = ["SERVICE_NAME", "AdminService", "serve_admin", "start_admin_server"]
