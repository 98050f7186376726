"""The one control plane of a multi-process gateway: the admin API in the supervisor.

Every change goes to every running serving process (each keeps its own fleet view) and
into the desired fleet, from which a restarted process starts. Answers are merged: a
worker as the lowest-numbered process sees it, with in-flight summed over processes.

Every call to a process has a deadline of its own (`READ_TIMEOUT_S` for what a process
answers from memory, the wait a change asks for plus `CHANGE_SLACK_S` for a change): a
wedged process (stopped, or its event loop stuck) costs one deadline, never a hang, and
the answer comes from the processes that answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeAlias

import grpc
import structlog
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from gateway.admin.service import (
    abort,
    duration_s,
    require_registered,
    require_removable,
    worker_spec,
)
from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.config import GatewayConfig
from gateway.core.tasks import TaskScope
from gateway.scale.desired import AdminStub, DesiredFleet

log = structlog.get_logger("gateway.control")

READ_TIMEOUT_S = 2.0  # a list, a watch event's in-flight merge: answered from memory
CHANGE_SLACK_S = 3.0  # a change's deadline: the wait it asks for (discovery, drain) + this

Context: TypeAlias = aio.ServicerContext


def merge_workers(views: Sequence[Sequence[pb.Worker]]) -> list[pb.Worker]:
    """One list from every process's list (process order): each worker as the first
    process that has it shows it, in-flight summed; sorted by id."""
    merged: dict[str, pb.Worker] = {}
    for workers in views:
        for worker in workers:
            seen_message = merged.get(worker.id)
            if seen_message is None:
                merged[worker.id] = copy = pb.Worker()
                copy.CopyFrom(worker)
            else:
                seen_message.inflight += worker.inflight
    return [merged[k] for k in sorted(merged)]


def one_worker(answers: Sequence[Any]) -> pb.Worker:
    """The one worker several processes answered about (each answer has `.worker`)."""
    return merge_workers([[a.worker] for a in answers])[0]


def _error(answer: object) -> aio.AioRpcError | None:
    return answer if isinstance(answer, aio.AioRpcError) else None


class NoAnswer(Exception):
    """A process did not answer within its deadline (stopped, wedged or overloaded)."""


async def within(call: Awaitable[Any], timeout_s: float) -> Any:
    """The call's answer, its error (an exception, returned), or NoAnswer once `timeout_s`
    passed (the call is cancelled: the process sees a cancelled RPC)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError:
        return NoAnswer(f"no answer within {timeout_s:g} s")
    except aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return NoAnswer(f"no answer within {timeout_s:g} s")
        return exc


def _no_replacement(admin: AdminStub, reason: str) -> None:
    """Without a supervisor (tests): a process that did not answer is only left out."""


class Reachable(Protocol):
    """A serving process as the control plane reaches it."""

    @property
    def admin(self) -> AdminStub | None: ...

    @property
    def running(self) -> bool: ...


class ControlPlane(admin_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    """AdminService over every running serving process (`processes` lists them in process
    order, at call time: a process being restarted is absent and catches up from the
    desired fleet when it is back).

    A process that does not answer within its deadline is left out of the answer. If
    the call was a change (add, remove, drain), nobody knows whether that process made
    it, so `replace(admin, reason)` is called: the supervisor kills that process and
    restarts it from the desired fleet, as it restarts one that died."""

    def __init__(
        self,
        config: GatewayConfig,
        desired: DesiredFleet,
        processes: Callable[[], Sequence[Reachable]],
        replace: Callable[[AdminStub, str], None] = _no_replacement,
        discovered_by: Callable[[str], list[str]] = lambda address: [],
        *,
        read_timeout_s: float = READ_TIMEOUT_S,
        change_slack_s: float = CHANGE_SLACK_S,
    ) -> None:
        self._config = config
        self._desired = desired
        self._processes = processes
        self._replace = replace
        self._discovered_by = discovered_by  # the discovery sources listing an address
        self._read_timeout_s = read_timeout_s
        self._change_slack_s = change_slack_s
        # Shielded changes that outlive their caller: held here, not only by the loop's
        # weak references, until they end.
        self._changes = TaskScope()

    async def close(self) -> None:
        """The supervisor stops (after the admin server): a change still running ends."""
        await self._changes.close()

    def _admins(self) -> list[AdminStub]:
        return [p.admin for p in self._processes() if p.admin is not None]

    async def _everywhere(
        self,
        call: Callable[[AdminStub], Awaitable[Any]],
        timeout_s: float | None = None,
        *,
        change: str = "",
    ) -> list[Any]:
        """Ask every running process at once, each within `timeout_s` (default: the read
        deadline); each answer or its error, in process order. A process that died
        meanwhile is left out: it restarts from the desired fleet. So is one that did not
        answer in time; if the call was a `change` (its name), that process is replaced."""
        deadline_s = self._read_timeout_s if timeout_s is None else timeout_s
        asked = [(p, p.admin) for p in self._processes() if p.admin is not None]
        answers = await asyncio.gather(
            *(within(call(admin), deadline_s) for _, admin in asked), return_exceptions=True
        )
        kept = []
        for (process, admin), answer in zip(asked, answers, strict=True):
            if isinstance(answer, NoAnswer):
                if change and process.running:
                    self._replace(admin, f"{change}: {answer}")
                continue
            if process.running or _error(answer) is None:
                kept.append(answer)
        return kept

    async def _known(self, worker_id: str, context: Context) -> None:
        known = worker_id in self._desired.specs or bool(self._discovered_by(worker_id))
        await require_registered(worker_id, known, context)

    async def AddWorker(
        self, request: pb.AddWorkerRequest, context: Context
    ) -> pb.AddWorkerResponse:
        """All or nothing over the processes that answer: one refusing (an error) undoes
        the add everywhere. A process that does not answer within the discovery timeout
        plus `CHANGE_SLACK_S` is not a refusal but a broken process: it is replaced
        (killed and restarted from the desired fleet, which holds the worker if the add
        stands and not if it was undone), so every process ends up with the same fleet.
        Counting it as a refusal instead would send it an undo it would not answer
        either, and leave it with a worker nobody else has if it woke up."""
        spec = await worker_spec(request.url, context)
        if spec.address in self._desired.specs:
            await abort(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker {spec.address} is already registered",
            )
        self._desired.add(spec, request.url)  # claimed before any await
        timeout = self._config.discovery_timeout_s + self._change_slack_s
        answers = await self._everywhere(
            lambda a: a.AddWorker(request), timeout, change="AddWorker"
        )
        failed = [e for e in map(_error, answers) if e is not None]
        added = [a for a in answers if isinstance(a, pb.AddWorkerResponse)]
        if failed or not added:
            # All or nothing: a worker some processes route to and others do not would be
            # a fleet nobody can reason about.
            self._desired.remove(spec.address)
            undo = pb.RemoveWorkerRequest(worker_id=spec.address, drain_timeout=Duration())
            await self._everywhere(
                lambda a: a.RemoveWorker(undo), self._change_slack_s, change="RemoveWorker"
            )
            if failed:
                await abort(context, failed[0].code(), str(failed[0].details()))
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process answered in time")
        log.info("control_add_worker", worker=spec.address, processes=len(added))
        return pb.AddWorkerResponse(worker=one_worker(added))

    async def RemoveWorker(
        self, request: pb.RemoveWorkerRequest, context: Context
    ) -> pb.RemoveWorkerResponse:
        await self._known(request.worker_id, context)
        await require_removable(request.worker_id, self._discovered_by(request.worker_id), context)
        drain_s = await duration_s(  # checked before any change
            request, "drain_timeout", self._config.drain.worker_timeout_s, context
        )
        self._desired.remove(request.worker_id)
        log.info("control_remove_worker", worker=request.worker_id)
        # Shielded: a removal once accepted completes even if the caller goes away.
        removal = self._everywhere(
            lambda a: a.RemoveWorker(request), drain_s + self._change_slack_s, change="RemoveWorker"
        )
        change = self._changes.spawn(removal, "control_remove_worker", worker=request.worker_id)
        answers = await asyncio.shield(change)
        removed = [a for a in answers if isinstance(a, pb.RemoveWorkerResponse)]
        if not removed:
            return pb.RemoveWorkerResponse(worker=pb.Worker(id=request.worker_id), drained=True)
        drained = all(a.drained for a in removed)
        return pb.RemoveWorkerResponse(worker=one_worker(removed), drained=drained)

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, context: Context
    ) -> pb.DrainWorkerResponse:
        await self._known(request.worker_id, context)
        wait_s = await duration_s(request, "wait", 0.0, context)  # checked before any change
        self._desired.drained.add(request.worker_id)
        log.info("control_drain_worker", worker=request.worker_id)
        answers = await self._everywhere(
            lambda a: a.DrainWorker(request), wait_s + self._change_slack_s, change="DrainWorker"
        )
        drained = [a for a in answers if isinstance(a, pb.DrainWorkerResponse)]
        if not drained:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process answered in time")
        emptied = all(a.drained for a in drained)
        return pb.DrainWorkerResponse(worker=one_worker(drained), drained=emptied)

    async def ResumeWorker(
        self, request: pb.ResumeWorkerRequest, context: Context
    ) -> pb.ResumeWorkerResponse:
        await self._known(request.worker_id, context)
        self._desired.drained.discard(request.worker_id)
        log.info("control_resume_worker", worker=request.worker_id)
        answers = await self._everywhere(
            lambda a: a.ResumeWorker(request), self._change_slack_s, change="ResumeWorker"
        )
        resumed = [a for a in answers if isinstance(a, pb.ResumeWorkerResponse)]
        refused = [a for a in answers if isinstance(a, aio.AioRpcError)]
        if not resumed:
            if refused:
                await abort(context, refused[0].code(), refused[0].details() or "")
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process answered in time")
        return pb.ResumeWorkerResponse(worker=one_worker(resumed))

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: Context
    ) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=await self.merged())

    async def ListQueues(
        self, request: pb.ListQueuesRequest, context: Context
    ) -> pb.ListQueuesResponse:
        """Every process's queues, summed by (model, class, tenant)."""
        answers = await self._everywhere(lambda a: a.ListQueues(pb.ListQueuesRequest()))
        replies = [a for a in answers if isinstance(a, pb.ListQueuesResponse)]
        summed: dict[tuple[str, str, str], int] = {}
        for reply in replies:
            for q in reply.queues:
                key = (q.model, q.priority, q.tenant)
                summed[key] = summed.get(key, 0) + q.waiting
        return pb.ListQueuesResponse(
            enabled=any(r.enabled for r in replies),
            queues=[
                pb.QueueDepth(model=m, priority=c, tenant=t, waiting=n)
                for (m, c, t), n in sorted(summed.items())
            ],
        )

    async def ListRoutes(
        self, request: pb.ListRoutesRequest, context: Context
    ) -> pb.ListRoutesResponse:
        """The routes as the lowest-numbered process that answers holds them (every
        process holds the same: SetRoute goes to all)."""
        answers = await self._everywhere(lambda a: a.ListRoutes(pb.ListRoutesRequest()))
        for answer in answers:
            if isinstance(answer, pb.ListRoutesResponse):
                return answer
        await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process answered in time")

    async def SetRoute(self, request: pb.SetRouteRequest, context: Context) -> pb.SetRouteResponse:
        """To every process; each checks the route against the same config, so they all
        take it or all refuse it. A restarted process is given the last one (`reconcile`)."""
        answers = await self._everywhere(
            lambda a: a.SetRoute(request), self._change_slack_s, change="SetRoute"
        )
        failed = [e for e in map(_error, answers) if e is not None]
        if failed:
            await abort(context, failed[0].code(), str(failed[0].details()))
        set_routes = [a for a in answers if isinstance(a, pb.SetRouteResponse)]
        if not set_routes:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process answered in time")
        self._desired.routes[request.alias] = request
        log.info("control_set_route", alias=request.alias, processes=len(set_routes))
        return set_routes[0]

    async def merged(self) -> list[pb.Worker]:
        """Every process's list, merged: a process that does not answer within the read
        deadline is left out (the supervisor's liveness check replaces a wedged one)."""
        answers = await self._everywhere(lambda a: a.ListWorkers(pb.ListWorkersRequest()))
        lists = [a.workers for a in answers if isinstance(a, pb.ListWorkersResponse)]
        return merge_workers(lists)

    async def WatchWorkers(
        self, request: pb.WatchWorkersRequest, context: Context
    ) -> AsyncIterator[pb.WatchWorkersResponse]:
        """The merged snapshot, then the events of the lowest-numbered running process
        (every process sees the same fleet), each with in-flight summed over processes
        (from those that answer within the read deadline). If that process stops, or is
        replaced because it stopped answering, the watch ends with UNAVAILABLE: watch
        again."""
        admins = self._admins()
        if not admins:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "no serving process is running")
        stream = admins[0].WatchWorkers(pb.WatchWorkersRequest())
        try:
            async for event in stream:
                if event.kind != pb.WORKER_EVENT_KIND_SNAPSHOT:
                    worker_message = event.worker
                    for worker in await self.merged():
                        if worker.id == worker_message.id:
                            worker_message.inflight = worker.inflight
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
