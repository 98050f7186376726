"""The fleet as the admin API left it (`DesiredFleet`), kept by the supervisor of
`--processes N`, and `reconcile`: bringing a serving process that (re)starts to it, so
every process serves the same fleet whatever happened while it was away."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import structlog
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.config import GatewayConfig, WorkerSpec
from gateway.upstream.worker import discovered_sources

log = structlog.get_logger("gateway.control")

RECONCILE_TIMEOUT_S = 5.0  # each catch-up call to a process that just started
AdminStub: TypeAlias = admin_pb2_grpc.AdminServiceStub


@dataclass
class DesiredFleet:
    """What the admin API made of the fleet: a process that starts now starts from it."""

    specs: dict[str, WorkerSpec]  # by worker id (HOST:PORT), in registration order
    urls: dict[str, str] = field(default_factory=dict)  # the URL each admin AddWorker gave
    drained: set[str] = field(default_factory=set)
    routes: dict[str, pb.SetRouteRequest] = field(default_factory=dict)  # by alias: the last

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


async def reconcile(
    admin: AdminStub,
    desired: DesiredFleet,
    index: int,
    discovery_timeout_s: float = 5.0,
    timeout_s: float = RECONCILE_TIMEOUT_S,
) -> None:
    """Bring a (re)started process's fleet to the desired one: what the admin API added,
    removed or drained since the process's start-up state was written. Each call has a
    deadline (`timeout_s`; an add: the discovery timeout on top): a process that does
    not answer raises AioRpcError (DEADLINE_EXCEEDED) here, and the supervisor's
    liveness check replaces it."""
    listed = await admin.ListWorkers(pb.ListWorkersRequest(), timeout=timeout_s)
    have = {w.id: w for w in listed.workers}
    add_s = discovery_timeout_s + timeout_s
    for worker_id, url in list(desired.urls.items()):
        if worker_id not in have:
            await _quiet(admin.AddWorker(pb.AddWorkerRequest(url=url), timeout=add_s))
    for worker_id, worker in have.items():
        if worker_id not in desired.specs and not discovered_sources(tuple(worker.sources)):
            request = pb.RemoveWorkerRequest(worker_id=worker_id, drain_timeout=Duration())
            await _quiet(admin.RemoveWorker(request, timeout=timeout_s))
    for worker_id in list(desired.drained):
        if worker_id in have and have[worker_id].status != pb.WORKER_STATUS_DRAINING:
            drain = pb.DrainWorkerRequest(worker_id=worker_id)
            await _quiet(admin.DrainWorker(drain, timeout=timeout_s))
    for route in list(desired.routes.values()):
        await _quiet(admin.SetRoute(route, timeout=timeout_s))
    log.debug("reconciled", serving_process=str(index), workers=len(desired.specs))


async def _quiet(call: Awaitable[Any]) -> None:
    """A failed step is logged; the next restart or admin call tries again."""
    try:
        await call
    except aio.AioRpcError as exc:
        log.warning("reconcile_call_failed", code=exc.code().name, details=exc.details())
