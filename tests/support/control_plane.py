"""Fake serving processes for the tests of `--processes N`'s control plane (no process is
started): a fake admin service whose answers a test holds back, late or refuses
(FakeAdmin), and how late a timer may fire here (LATE_S)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from grpc import aio

from gateway.admin.v1 import admin_pb2 as pb

LATE_S = 0.4  # how late a timer may fire on an idle machine (the timing tier's bounds)


def worker(wid: str, inflight: int = 0) -> pb.Worker:
    return pb.Worker(id=wid, model="m", inflight=inflight, status=pb.WORKER_STATUS_READY)


@dataclass
class FakeAdmin:
    """One serving process's admin API. `wedged`: every call waits forever (a SIGSTOPped
    process); `delay_s`: every call answers after that long; `refuse_add`: AddWorker
    fails with it; `journal` (shared by several) records each call's "asked" and a wedged
    call's "expired" (its deadline cancelled it), in order."""

    workers: dict[str, pb.Worker] = field(default_factory=dict)
    wedged: bool = False
    delay_s: float = 0.0
    refuse_add: aio.AioRpcError | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    events: list[pb.WatchWorkersResponse] = field(default_factory=list)
    journal: list[str] = field(default_factory=list)

    async def _enter(self, name: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((name, kwargs))
        self.journal.append("asked")
        if self.wedged:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.journal.append("expired")
                raise
        await asyncio.sleep(self.delay_s)

    async def AddWorker(self, request: pb.AddWorkerRequest, **kw: Any) -> pb.AddWorkerResponse:
        await self._enter("add", kw)
        if self.refuse_add is not None:
            raise self.refuse_add
        wid = request.url.removeprefix("grpc://").partition("?")[0]
        self.workers[wid] = worker(wid)
        return pb.AddWorkerResponse(worker=self.workers[wid])

    async def RemoveWorker(
        self, request: pb.RemoveWorkerRequest, **kw: Any
    ) -> pb.RemoveWorkerResponse:
        await self._enter("remove", kw)
        gone = self.workers.pop(request.worker_id, None) or worker(request.worker_id)
        return pb.RemoveWorkerResponse(worker=gone, drained=True)

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, **kw: Any
    ) -> pb.DrainWorkerResponse:
        await self._enter("drain", kw)
        seen = self.workers[request.worker_id]
        seen.status = pb.WORKER_STATUS_DRAINING
        return pb.DrainWorkerResponse(worker=seen, drained=seen.inflight == 0)

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, **kw: Any
    ) -> pb.ListWorkersResponse:
        await self._enter("list", kw)
        return pb.ListWorkersResponse(workers=list(self.workers.values()))

    def WatchWorkers(self, request: pb.WatchWorkersRequest) -> FakeWatch:
        return FakeWatch(self.events)


@dataclass
class FakeWatch:
    events: list[pb.WatchWorkersResponse]
    cancelled: bool = False

    async def __aiter__(self) -> AsyncIterator[pb.WatchWorkersResponse]:
        for event in self.events:
            yield event

    def cancel(self) -> None:
        self.cancelled = True
