"""AdminService in-process: a real Fleet (no workers to start with), the admin server on
127.0.0.1:0, the generated stub over grpc.aio: adding, listing, draining and removing
workers, the watch, the token, reflection."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from gateway.admin.service import AdminService
from gateway.admin.v1 import admin_pb2 as pb
from gateway.config import build_config
from gateway.upstream.registry import FleetEvent
from gateway_sim.client import free_port
from tests.support import admin_server
from tests.support.admin_server import TOKEN, Admin, start, stop

admin = admin_server.admin  # the fixture (tests/support/admin_server.py)


def seconds(value: float) -> Duration:
    duration = Duration()
    duration.FromTimedelta(timedelta(seconds=value))
    return duration


async def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(aio.AioRpcError) as raised:
        await call
    code: grpc.StatusCode = raised.value.code()
    return code


async def test_add_worker_validates_and_registers(admin: Admin) -> None:
    with pytest.raises(aio.AioRpcError) as bad:
        await admin.stub.AddWorker(pb.AddWorkerRequest(url="http://127.0.0.1:1"))
    assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad.value.details() == "worker 'http://127.0.0.1:1': scheme must be grpc:// or grpcs://"

    port = free_port()
    url = f"grpc://127.0.0.1:{port}?model=m&runtime=sglang&role=prefill&bootstrap_port=8998"
    added = (await admin.stub.AddWorker(pb.AddWorkerRequest(url=url))).worker
    assert added.id == f"127.0.0.1:{port}"
    assert added.url == url
    assert (added.model, added.runtime, added.role) == ("m", "sglang", pb.ROLE_PREFILL)
    assert added.status == pb.WORKER_STATUS_PENDING  # nobody answers: never probed healthy
    assert added.breaker_state == pb.BREAKER_STATE_CLOSED
    assert added.inflight == 0
    assert added.bootstrap_port == 8998
    assert not added.HasField("load")
    assert admin.fleet.registry.get(added.id) is not None

    with pytest.raises(aio.AioRpcError) as dup:
        await admin.stub.AddWorker(pb.AddWorkerRequest(url=url))
    assert dup.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert added.id in (dup.value.details() or "")


async def test_add_worker_that_cannot_be_discovered_is_unavailable(admin: Admin) -> None:
    """Without model and runtime the fleet must ask the worker; bounded by the discovery
    timeout, after which nothing is left registered or joining."""
    port = free_port()
    with pytest.raises(aio.AioRpcError) as raised:
        await admin.stub.AddWorker(pb.AddWorkerRequest(url=f"grpc://127.0.0.1:{port}"))
    assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "model=" in (raised.value.details() or "")
    assert len(admin.fleet.registry) == 0
    url = f"grpc://127.0.0.1:{port}?model=m&runtime=vllm"
    assert (await admin.stub.AddWorker(pb.AddWorkerRequest(url=url))).worker.runtime == "vllm"


async def test_list_drain_remove(admin: Admin) -> None:
    ports = sorted(free_port() for _ in range(2))
    for port in reversed(ports):
        url = f"grpc://127.0.0.1:{port}?model=m&runtime=sglang"
        await admin.stub.AddWorker(pb.AddWorkerRequest(url=url))
    listed = (await admin.stub.ListWorkers(pb.ListWorkersRequest())).workers
    assert [w.id for w in listed] == sorted(f"127.0.0.1:{p}" for p in ports)
    first = listed[0].id

    drained = await admin.stub.DrainWorker(pb.DrainWorkerRequest(worker_id=first))
    assert drained.drained
    assert drained.worker.status == pb.WORKER_STATUS_DRAINING
    assert admin.fleet.registry.get(first) is not None  # still registered

    # An in-flight request that never finishes: the drain times out, the worker goes anyway.
    worker = admin.fleet.registry.get(first)
    assert worker is not None
    worker.inflight = 1
    removed = await admin.stub.RemoveWorker(
        pb.RemoveWorkerRequest(worker_id=first, drain_timeout=seconds(0.05))
    )
    assert not removed.drained
    assert removed.worker.id == first and removed.worker.inflight == 1
    listed = (await admin.stub.ListWorkers(pb.ListWorkersRequest())).workers
    assert [w.id for w in listed] == [f"127.0.0.1:{ports[1]}"]

    removed = await admin.stub.RemoveWorker(pb.RemoveWorkerRequest(worker_id=listed[0].id))
    assert removed.drained
    assert len(admin.fleet.registry) == 0

    for call in (
        admin.stub.RemoveWorker(pb.RemoveWorkerRequest(worker_id=first)),
        admin.stub.DrainWorker(pb.DrainWorkerRequest(worker_id="10.0.0.1:1")),
    ):
        assert await code_of(call) is grpc.StatusCode.NOT_FOUND
    assert await code_of(admin.stub.DrainWorker(pb.DrainWorkerRequest())) is (
        grpc.StatusCode.INVALID_ARGUMENT
    )


async def test_watch_sends_snapshot_then_events_and_unsubscribes(admin: Admin) -> None:
    registry = admin.fleet.registry  # white box: the watcher must unsubscribe
    baseline = len(registry._listeners)
    first = f"127.0.0.1:{free_port()}"
    await admin.stub.AddWorker(pb.AddWorkerRequest(url=f"grpc://{first}?model=m&runtime=sglang"))

    call = admin.stub.WatchWorkers(pb.WatchWorkersRequest())
    snapshot = await asyncio.wait_for(call.read(), 5)
    assert snapshot.kind == pb.WORKER_EVENT_KIND_SNAPSHOT
    assert snapshot.worker.id == first
    assert len(registry._listeners) == baseline + 1

    second = f"127.0.0.1:{free_port()}"
    await admin.stub.AddWorker(pb.AddWorkerRequest(url=f"grpc://{second}?model=v&runtime=vllm"))
    while True:  # the first worker's probes may report in between
        event = await asyncio.wait_for(call.read(), 5)
        if event.kind == pb.WORKER_EVENT_KIND_ADDED:
            break
        assert event.kind in (pb.WORKER_EVENT_KIND_STATUS, pb.WORKER_EVENT_KIND_BREAKER)
    assert event.worker.id == second and event.worker.model == "v"
    assert event.HasField("time")

    await admin.stub.DrainWorker(pb.DrainWorkerRequest(worker_id=second))
    while True:
        event = await asyncio.wait_for(call.read(), 5)
        if event.worker.id == second and event.kind == pb.WORKER_EVENT_KIND_STATUS:
            break
    assert event.status_change.new_status == pb.WORKER_STATUS_DRAINING
    assert event.cause == "draining"

    call.cancel()
    for _ in range(100):
        if len(registry._listeners) == baseline:
            break
        await asyncio.sleep(0.01)
    assert len(registry._listeners) == baseline


class AbortError(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise AbortError(details)


async def test_slow_watcher_is_cut_off_not_the_fleet(admin: Admin) -> None:
    """The listener never blocks the fleet: past the queue bound the watcher ends with
    RESOURCE_EXHAUSTED after the events it did get, and is unsubscribed."""
    url = f"grpc://127.0.0.1:{free_port()}?model=m&runtime=sglang"
    worker = await admin.fleet.add(build_config(worker_urls=[url]).workers[0])
    service = AdminService(admin.fleet, admin.fleet.settings, watch_queue_size=2)
    context = FakeContext()
    stream = service.WatchWorkers(pb.WatchWorkersRequest(), context)
    assert (await anext(stream)).kind == pb.WORKER_EVENT_KIND_SNAPSHOT
    listeners = len(admin.fleet.registry._listeners)
    for n in range(5):  # synchronous, as the fleet publishes: must not block or raise
        admin.fleet.registry.publish(FleetEvent("outlier", worker, "closed", "open", f"e{n}"))
    assert len(admin.fleet.registry._listeners) == listeners - 1
    assert [(await anext(stream)).cause for _ in range(2)] == ["e0", "e1"]
    with pytest.raises(AbortError, match="fell more than 2 events behind"):
        await anext(stream)
    assert context.code is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_token_is_required_when_configured() -> None:
    admin = await start(token=TOKEN)
    try:
        for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            call = admin.stub.ListWorkers(pb.ListWorkersRequest(), metadata=metadata)
            assert await code_of(call) is grpc.StatusCode.UNAUTHENTICATED
        # Streaming methods too.
        watch = admin.stub.WatchWorkers(pb.WatchWorkersRequest())
        assert await code_of(watch.read()) is grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {TOKEN}"),)
        listed = await admin.stub.ListWorkers(pb.ListWorkersRequest(), metadata=good)
        assert list(listed.workers) == []
    finally:
        await stop(admin)


async def test_reflection_lists_the_admin_service(admin: Admin) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(admin.channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert "gateway.admin.v1.AdminService" in names


async def test_add_worker_refuses_oversized_or_odd_model_names(admin: Admin) -> None:
    for url, message in (
        ("grpc://127.0.0.1:1?model=" + "m" * 100_000, "worker URL longer than 2048 characters"),
        (
            "grpc://127.0.0.1:1?model=" + "m" * 300,
            f"worker 'grpc://127.0.0.1:1?model={'m' * 300}': model name longer than 256 characters",
        ),
        (
            "grpc://127.0.0.1:1?model=%3Cscript%3E",
            "worker 'grpc://127.0.0.1:1?model=%3Cscript%3E': model name '<script>' has "
            "characters other than letters, digits and . _ : / @ + -",
        ),
    ):
        with pytest.raises(aio.AioRpcError) as bad:
            await admin.stub.AddWorker(pb.AddWorkerRequest(url=url))
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert bad.value.details() == message
    assert len(admin.fleet.registry) == 0
