"""ResumeWorker: a drained worker back in rotation; a worker on its way out (RemoveWorker,
or its source no longer listing it) stays on its way out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from gateway.admin.service import start_admin_server
from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.config import build_config
from gateway.engines import engine_adapters
from gateway.placement.policies import build_policy
from gateway.upstream.manager import Fleet
from gateway.upstream.worker import WorkerStatus
from gateway_sim.client import free_port
from tests.support.waits import until


@pytest.fixture
async def admin() -> AsyncIterator[tuple[Fleet, Any]]:
    config = build_config(overrides={"admin.listen": "127.0.0.1:0"})
    fleet = Fleet(config, engine_adapters(), build_policy)
    await fleet.start(())
    server, port, service = await start_admin_server(fleet, config)
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield fleet, admin_pb2_grpc.AdminServiceStub(channel)
    await server.stop(None)
    await service.close()
    await fleet.close()


async def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(aio.AioRpcError) as raised:
        await call
    code: grpc.StatusCode = raised.value.code()
    return code


async def test_resume_undoes_a_drain_but_not_a_removal(admin: tuple[Fleet, Any]) -> None:
    fleet, stub = admin
    first = f"127.0.0.1:{free_port()}"  # nothing listens there
    await stub.AddWorker(pb.AddWorkerRequest(url=f"grpc://{first}?model=m&runtime=sglang"))
    worker = fleet.registry.get(first)
    assert worker is not None
    await stub.DrainWorker(pb.DrainWorkerRequest(worker_id=first))
    assert worker.status is WorkerStatus.DRAINING
    resumed = await stub.ResumeWorker(pb.ResumeWorkerRequest(worker_id=first))
    assert resumed.worker.status != pb.WORKER_STATUS_DRAINING  # its probes decide now
    assert not worker.draining and worker.status is not WorkerStatus.DRAINING
    again = await stub.ResumeWorker(pb.ResumeWorkerRequest(worker_id=first))
    assert again.worker.id == first  # a worker in rotation: nothing changes

    worker.inflight = 1  # a removal waiting on its last call
    wait = Duration()
    wait.FromTimedelta(timedelta(seconds=5))
    removal = asyncio.ensure_future(
        stub.RemoveWorker(pb.RemoveWorkerRequest(worker_id=first, drain_timeout=wait))
    )
    try:
        await until(lambda: worker.removing, what="the removal under way")
        refused = stub.ResumeWorker(pb.ResumeWorkerRequest(worker_id=first))
        assert await code_of(refused) is grpc.StatusCode.FAILED_PRECONDITION
        assert worker.draining
    finally:
        worker.release()  # its last call ends: the removal completes
        await removal
    gone = stub.ResumeWorker(pb.ResumeWorkerRequest(worker_id=first))
    assert await code_of(gone) is grpc.StatusCode.NOT_FOUND
