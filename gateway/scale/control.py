"""The one control plane of a multi-process gateway: the admin API in the supervisor.

Every change goes to every running serving process (each keeps its own fleet view) and
into the desired fleet, from which a restarted process starts. Answers are merged: a
worker as the lowest-numbered process sees it, with in-flight summed over processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import grpc
import structlog
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from gateway.admin.service import abort, duration_s, require_registered, worker_spec
from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.config import GatewayConfig, WorkerSpec

log = structlog.get_logger("gateway.control")

Context: TypeAlias = aio.ServicerContext
AdminStub: TypeAlias = admin_pb2_grpc.AdminServiceStub


@dataclass
class DesiredFleet:
    """What the admin API made of the fleet: a process that starts now starts from it."""

    specs: dict[str, WorkerSpec]  # by worker id (HOST:PORT), in registration order
    urls: dict[str, str] = field(default_factory=dict)  # the URL each admin AddWorker gave
    drained: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, config: GatewayConfig) -> DesiredFleet:
        return cls({spec.address: spec for spec in config.workers})

    def add(self, spec: WorkerSpec, url: str) -> None:
        self.specs[spec.address], self.urls[spec.address] = spec, url
        self.drained.discard(spec.address)

    def remove(self, worker_id: str) -> None:
        self.specs.pop(worker_id, None)
        self.urls.pop(worker_id, None)
        self.drained.discard(worker_id)


def merge_workers(views: Sequence[Sequence[pb.Worker]]) -> list[pb.Worker]:
    """One list from every process's list (process order): each worker as the first
    process that has it shows it, in-flight summed; sorted by id."""
    merged: dict[str, pb.Worker] = {}
    for workers in views:
        for worker in workers:
            seen = merged.get(worker.id)
            if seen is None:
                merged[worker.id] = copy = pb.Worker()
                copy.CopyFrom(worker)
            else:
                seen.inflight += worker.inflight
    return [merged[k] for k in sorted(merged)]


def one_worker(answers: Sequence[Any]) -> pb.Worker:
    """The one worker several processes answered about (each answer has `.worker`)."""
    return merge_workers([[a.worker] for a in answers])[0]


def _error(answer: object) -> aio.AioRpcError | None:
    return answer if isinstance(answer, aio.AioRpcError) else None


class Reachable(Protocol):
    """A serving process as the control plane reaches it."""

    @property
    def admin(self) -> AdminStub | None: ...

    @property
    def running(self) -> bool: ...


class ControlPlane(admin_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    """AdminService over every running serving process (`processes` lists them in process
    order, at call time: a process being restarted is absent and catches up from the
    desired fleet when it is back)."""

    def __init__(
        self,
        config: GatewayConfig,
        desired: DesiredFleet,
        processes: Callable[[], Sequence[Reachable]],
    ) -> None:
        self._config = config
        self._desired = desired
        self._processes = processes

    def _admins(self) -> list[AdminStub]:
        return [p.admin for p in self._processes() if p.admin is not None]

    async def _everywhere(self, call: Callable[[AdminStub], Awaitable[Any]]) -> list[Any]:
        """Ask every running process; each answer or its error, in process order. A
        process that died meanwhile is left out: it restarts from the desired fleet."""
        asked = [p for p in self._processes() if p.admin is not None]
        answers = await asyncio.gather(
            *(call(p.admin) for p in asked if p.admin is not None), return_exceptions=True
        )
        return [a for p, a in zip(asked, answers, strict=True) if p.running or _error(a) is None]

    async def _known(self, worker_id: str, context: Context) -> None:
        await require_registered(worker_id, worker_id in self._desired.specs, context)

    async def AddWorker(
        self, request: pb.AddWorkerRequest, context: Context
    ) -> pb.AddWorkerResponse:
        spec = await worker_spec(request.url, context)
        if spec.address in self._desired.specs:
            await abort(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker {spec.address} is already registered",
            )
        self._desired.add(spec, request.url)  # claimed before any await
        timeout = self._config.discovery_timeout_s + 5.0
        answers = await self._everywhere(lambda a: a.AddWorker(request, timeout=timeout))
        failed = [e for e in map(_error, answers) if e is not None]
        added = [a for a in answers if isinstance(a, pb.AddWorkerResponse)]
        if failed or not added:
            # All or nothing: a worker some processes route to and others do not would be
            # a fleet nobody can reason about.
            self._desired.remove(spec.address)
            undo = pb.RemoveWorkerRequest(worker_id=spec.address, drain_timeout=Duration())
            await self._everywhere(lambda a: a.RemoveWorker(undo, timeout=timeout))
            if failed:
                await abort(context, failed[0].code(), str(failed[0].details()))
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process is running")
        log.info("control_add_worker", worker=spec.address, processes=len(added))
        return pb.AddWorkerResponse(worker=one_worker(added))

    async def RemoveWorker(
        self, request: pb.RemoveWorkerRequest, context: Context
    ) -> pb.RemoveWorkerResponse:
        await self._known(request.worker_id, context)
        await duration_s(request, "drain_timeout", 0.0, context)  # checked before any change
        self._desired.remove(request.worker_id)
        log.info("control_remove_worker", worker=request.worker_id)
        # Shielded: a removal once accepted completes even if the caller goes away.
        answers = await asyncio.shield(self._everywhere(lambda a: a.RemoveWorker(request)))
        removed = [a for a in answers if isinstance(a, pb.RemoveWorkerResponse)]
        if not removed:
            return pb.RemoveWorkerResponse(worker=pb.Worker(id=request.worker_id), drained=True)
        drained = all(a.drained for a in removed)
        return pb.RemoveWorkerResponse(worker=one_worker(removed), drained=drained)

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, context: Context
    ) -> pb.DrainWorkerResponse:
        await self._known(request.worker_id, context)
        await duration_s(request, "wait", 0.0, context)  # checked before any change
        self._desired.drained.add(request.worker_id)
        log.info("control_drain_worker", worker=request.worker_id)
        answers = await self._everywhere(lambda a: a.DrainWorker(request))
        drained = [a for a in answers if isinstance(a, pb.DrainWorkerResponse)]
        if not drained:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process is running")
        emptied = all(a.drained for a in drained)
        return pb.DrainWorkerResponse(worker=one_worker(drained), drained=emptied)

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: Context
    ) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=await self.merged())

    async def merged(self) -> list[pb.Worker]:
        answers = await self._everywhere(lambda a: a.ListWorkers(pb.ListWorkersRequest()))
        lists = [a.workers for a in answers if isinstance(a, pb.ListWorkersResponse)]
        return merge_workers(lists)

    async def WatchWorkers(
        self, request: pb.WatchWorkersRequest, context: Context
    ) -> AsyncIterator[pb.WatchWorkersResponse]:
        """The merged snapshot, then the events of the lowest-numbered running process
        (every process sees the same fleet), each with in-flight summed over processes.
        If that process stops, the watch ends with UNAVAILABLE: watch again."""
        admins = self._admins()
        if not admins:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process is running")
        stream = admins[0].WatchWorkers(pb.WatchWorkersRequest())
        try:
            async for event in stream:
                if event.kind != pb.WORKER_EVENT_KIND_SNAPSHOT:
                    for worker in await self.merged():
                        if worker.id == event.worker.id:
                            event.worker.inflight = worker.inflight
                yield event
        except aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                await abort(context, exc.code(), str(exc.details()))
        finally:
            stream.cancel()
        await abort(
            context,
            grpc.StatusCode.UNAVAILABLE,
            "the serving process this watch followed stopped; watch again",
        )


async def reconcile(admin: AdminStub, desired: DesiredFleet, index: int) -> None:
    """Bring a (re)started process's fleet to the desired one: what the admin API added,
    removed or drained since the process's start-up state was written."""
    listed = await admin.ListWorkers(pb.ListWorkersRequest(), timeout=10.0)
    have = {w.id: w for w in listed.workers}
    for worker_id, url in list(desired.urls.items()):
        if worker_id not in have:
            await _quiet(admin.AddWorker(pb.AddWorkerRequest(url=url), timeout=10.0))
    for worker_id in have:
        if worker_id not in desired.specs:
            request = pb.RemoveWorkerRequest(worker_id=worker_id, drain_timeout=Duration())
            await _quiet(admin.RemoveWorker(request, timeout=10.0))
    for worker_id in list(desired.drained):
        if worker_id in have and have[worker_id].status != pb.WORKER_STATUS_DRAINING:
            await _quiet(admin.DrainWorker(pb.DrainWorkerRequest(worker_id=worker_id)))
    log.debug("reconciled", serving_process=index, workers=len(desired.specs))


async def _quiet(call: Awaitable[Any]) -> None:
    """A failed step is logged; the next restart or admin call tries again."""
    try:
        await call
    except aio.AioRpcError as exc:
        log.warning("reconcile_call_failed", code=exc.code().name, details=exc.details())
