"""AdminService in-process: a real Fleet (no workers to start with), the admin server on
127.0.0.1:0, the generated stub over grpc.aio; then the `gateway workers` verbs against it."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
import pytest
import structlog
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from gateway.admin.client import add_workers_arguments, run_workers
from gateway.admin.service import AdminService, start_admin_server
from gateway.admin.text import format_table
from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.config import build_config
from gateway.engines import engine_adapters
from gateway.placement.policies import build_policy
from gateway.upstream.manager import Fleet
from gateway.upstream.registry import FleetEvent

TOKEN = "s3cret"


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def seconds(value: float) -> Duration:
    duration = Duration()
    duration.FromTimedelta(timedelta(seconds=value))
    return duration


@dataclass
class Admin:
    fleet: Fleet
    server: aio.Server
    service: AdminService
    port: int
    channel: aio.Channel
    stub: Any  # admin_pb2_grpc.AdminServiceStub (untyped generated code)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start(token: str | None = None) -> Admin:
    config = build_config(
        overrides={
            "admin.listen": "127.0.0.1:0",
            "admin.token": token,
            "discovery_timeout_s": 0.5,
        }
    )
    fleet = Fleet(config, engine_adapters(), build_policy)
    await fleet.start(())
    server, port, service = await start_admin_server(fleet, config)
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    return Admin(fleet, server, service, port, channel, admin_pb2_grpc.AdminServiceStub(channel))


async def stop(admin: Admin) -> None:
    await admin.channel.close()
    await admin.server.stop(None)
    await admin.service.close()
    await admin.fleet.close()


@pytest.fixture
async def admin() -> AsyncIterator[Admin]:
    started = await start()
    yield started
    await stop(started)


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

    port = closed_port()
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
    port = closed_port()
    with pytest.raises(aio.AioRpcError) as raised:
        await admin.stub.AddWorker(pb.AddWorkerRequest(url=f"grpc://127.0.0.1:{port}"))
    assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "model=" in (raised.value.details() or "")
    assert len(admin.fleet.registry) == 0
    url = f"grpc://127.0.0.1:{port}?model=m&runtime=vllm"
    assert (await admin.stub.AddWorker(pb.AddWorkerRequest(url=url))).worker.runtime == "vllm"


async def test_list_drain_remove(admin: Admin) -> None:
    ports = sorted(closed_port() for _ in range(2))
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
    first = f"127.0.0.1:{closed_port()}"
    await admin.stub.AddWorker(pb.AddWorkerRequest(url=f"grpc://{first}?model=m&runtime=sglang"))

    call = admin.stub.WatchWorkers(pb.WatchWorkersRequest())
    snapshot = await asyncio.wait_for(call.read(), 5)
    assert snapshot.kind == pb.WORKER_EVENT_KIND_SNAPSHOT
    assert snapshot.worker.id == first
    assert len(registry._listeners) == baseline + 1

    second = f"127.0.0.1:{closed_port()}"
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
    url = f"grpc://127.0.0.1:{closed_port()}?model=m&runtime=sglang"
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


# --- the `gateway workers ...` verbs ------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gateway workers")
    add_workers_arguments(parser)
    return parser.parse_args(list(argv))


async def cli(*argv: str) -> int:
    """run_workers runs its own event loop: call it from a thread, as the CLI would.

    The in-process fleet's log lines are captured apart, so stdout holds only the CLI's."""
    with structlog.testing.capture_logs():
        return await asyncio.to_thread(run_workers, parse(*argv))


async def test_cli_verbs(admin: Admin, capsys: pytest.CaptureFixture[str]) -> None:
    at = ("--admin", admin.address)
    assert await cli("list", *at) == 0
    assert capsys.readouterr().out == "no workers registered\n"

    worker_id = f"127.0.0.1:{closed_port()}"
    assert await cli("add", f"grpc://{worker_id}?model=m&runtime=sglang", *at) == 0
    out = capsys.readouterr().out
    assert out == f"added {worker_id} (model m, runtime sglang, role regular): pending\n"

    assert await cli("list", *at) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:8] == [
        "WORKER", "MODEL", "RUNTIME", "ROLE", "SOURCE", "STATUS", "INFLIGHT", "OUTLIER"
    ]  # fmt: skip
    assert row.split()[:8] == [
        worker_id, "m", "sglang", "regular", "admin", "pending", "0", "closed"
    ]  # fmt: skip

    assert await cli("list", "--json", *at) == 0
    (line,) = capsys.readouterr().out.splitlines()
    listed = json.loads(line)
    assert (listed["id"], listed["status"]) == (worker_id, "WORKER_STATUS_PENDING")
    assert listed["inflight"] == 0  # zero values are printed, not left out

    assert await cli("watch", "--count", "1", *at) == 0
    out = capsys.readouterr().out
    assert f"snapshot {worker_id} m sglang regular" in out

    assert await cli("drain", worker_id, *at) == 0
    assert capsys.readouterr().out == f"draining {worker_id} (idle)\n"

    assert await cli("remove", worker_id, "--drain-timeout", "1", *at) == 0
    assert capsys.readouterr().out == f"removed {worker_id} (drained)\n"

    assert await cli("remove", worker_id, *at) == 3  # NOT_FOUND
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"gateway: NOT_FOUND: no worker '{worker_id}' is registered\n"

    assert await cli("add", "grpc://nohost", *at) == 2  # INVALID_ARGUMENT
    assert capsys.readouterr().err.startswith("gateway: INVALID_ARGUMENT: worker 'grpc://nohost'")


async def test_cli_token_from_flag_or_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = await start(token=TOKEN)
    try:
        at = ("--admin", admin.address)
        monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
        assert await cli("list", *at) == 6
        assert capsys.readouterr().err.startswith("gateway: UNAUTHENTICATED: ")
        assert await cli("list", "--token", TOKEN, *at) == 0
        monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
        assert await cli("list", *at) == 0
        assert capsys.readouterr().out == "no workers registered\n" * 2
    finally:
        await stop(admin)


async def test_cli_unreachable_admin_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert await cli("list", "--admin", f"127.0.0.1:{closed_port()}") == 5
    assert capsys.readouterr().err.startswith("gateway: UNAVAILABLE: ")


def test_table_shows_load_probe_and_errors() -> None:
    worker = pb.Worker(
        id="h:1",
        model="m",
        runtime="vllm",
        role=pb.ROLE_DECODE,
        status=pb.WORKER_STATUS_READY,
        status_cause="probe: grpc.health SERVING",
        inflight=2,
        breaker_state=pb.BREAKER_STATE_HALF_OPEN,
        load_error="UNAVAILABLE: gone",
        sources=["dns:w.llm", "static"],
    )
    worker.load.running, worker.load.waiting, worker.load.token_usage = 5, 1, 0.42
    worker.last_probe.kind = pb.PROBE_KIND_SERVING
    worker.last_probe.time.FromSeconds(100)
    _, row = format_table([worker], now=102.5).splitlines()
    assert row.split("  ")[0] == "h:1"
    assert row.split() == [
        "h:1", "m", "vllm", "decode", "dns:w.llm,static", "ready", "2", "half_open", "5", "1",
        "42%", "-", "serving", "2.5s", "ago", "probe:", "grpc.health", "SERVING;", "load:",
        "UNAVAILABLE:", "gone",
    ]  # fmt: skip


def test_table_shows_a_worker_not_yet_identified_with_what_its_url_leaves_open() -> None:
    worker = pb.Worker(
        id="h:1",
        model="m",
        status=pb.WORKER_STATUS_UNIDENTIFIED,
        status_cause="health check failed: UNAVAILABLE: refused",
        sources=["static"],
    )
    _, row = format_table([worker], now=0).splitlines()
    assert row.split()[:7] == ["h:1", "m", "?", "?", "static", "unidentified", "0"]
    assert row.endswith("health check failed: UNAVAILABLE: refused")


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
