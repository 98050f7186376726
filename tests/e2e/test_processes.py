"""`gateway serve --processes 2`: two serving processes behind one port, one control
plane, one /metrics; aborts across processes; drain and restart. Real processes.

A connection lands on one process (SO_REUSEPORT spreads connections, not calls), so
each test opens connections until it holds one on every process: the request log names
the process that answered.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.admin.v1 import admin_pb2 as admin
from gateway.scale.supervisor import FIRST_BACKOFF_S
from gateway_sim.client import POLL_S, collect, model_md, sgl, sgl_generate, sgl_grpc
from gateway_sim.launch import worker_url
from tests.support.helpers import ABORT_COMPLETES, request_events
from tests.support.launch import STOP_S, Launcher
from tests.support.processes import (
    PROCESSES,
    admin_stub,
    alive,
    healthy,
    per_process,
    scrape,
    serving_processes,
    wait_servable,
)
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S


@pytest.fixture
async def closing() -> AsyncIterator[list[aio.Channel]]:
    channels: list[aio.Channel] = []
    yield channels
    for ch in channels:
        await ch.close()


async def test_both_processes_serve_generate_and_the_log_names_each(
    sim: Launcher, gateway: Launcher, closing: list[aio.Channel]
) -> None:
    worker = sim("--model", "m")
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    channels = await per_process(gw)
    closing.extend(channels.values())
    for index, ch in sorted(channels.items()):
        await wait_servable(ch, "m")
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(f"on-{index}"), metadata=model_md("m")
        )
        messages, error = await collect(call)
        assert error is None and len(messages) == 5
    # The standard health service answers the same on either process.
    for ch in channels.values():
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "readiness", "models/m"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    events = request_events(gw.log_path, "Generate")
    served = {e["request_id"]: (e["process"], e["code"], e["worker"]) for e in events}
    assert served == {
        "on-0": ("0", "OK", worker.address),
        "on-1": ("1", "OK", worker.address),
    }
    # One /metrics: every process's calls counted once, worker state not doubled.
    samples = scrape(gw)
    key = 'gateway_requests_total{code="OK",model="m",rpc="Generate",service="%s"}'
    assert samples[key % "sglang.grpc.scheduler.SglangScheduler"] == 2.0
    assert (
        samples[
            f'gateway_worker_up{{model="m",role="regular",runtime="sglang",worker="{worker.address}"}}'
        ]
        == 1.0
    )
    assert samples["gateway_serving_processes"] == 2.0
    closed = f'gateway_worker_outlier{{state="closed",worker="{worker.address}"}}'
    assert samples[closed] == 1.0
    assert [v for k, v in samples.items() if k.startswith("gateway_build_info{")] == [1.0]
    # The supervisor's and both serving processes' own series, merged (process_*).
    assert samples["process_resident_memory_bytes"] > 0
    assert samples["process_start_time_seconds"] > 0
    assert not [k for k in samples if "_created" in k]
    assert gw.stop(STOP_S) == 0


async def test_an_added_worker_is_soon_used_by_every_process(
    sim: Launcher, gateway: Launcher, closing: list[aio.Channel], strict: bool
) -> None:
    """Servable on every process soon after AddWorker answers: within 1 s (timing tier),
    else within 2 s plus five times what the AddWorker call itself took (a measure of how
    slowly the processes answer right now; a busy machine stretches both)."""
    first, added = sim("--model", "m"), sim("--model", "late")
    gw = gateway(*PROCESSES, "--worker", worker_url(first, model="m", runtime="sglang"))
    channels = await per_process(gw)
    closing.extend(channels.values())
    assert not any([await healthy(ch, "late") for ch in channels.values()])
    ach, stub = admin_stub(gw)
    closing.append(ach)
    watch = stub.WatchWorkers(admin.WatchWorkersRequest())
    snapshot = await watch.read()
    assert (snapshot.kind, snapshot.worker.id) == (admin.WORKER_EVENT_KIND_SNAPSHOT, first.address)
    url = worker_url(added, model="late", runtime="sglang")
    run_alone()
    asked = time.monotonic()
    reply = await stub.AddWorker(admin.AddWorkerRequest(url=url), timeout=10)
    assert reply.worker.id == added.address
    answered = time.monotonic()
    servable = await asyncio.gather(*(wait_servable(ch, "late") for ch in channels.values()))
    assert max(servable) - answered < 2.0 + 5 * (answered - asked)
    if strict:
        assert max(servable) - answered < 1.0
    for ch in channels.values():
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("late"))
        _, error = await collect(call)
        assert error is None
    # The one control plane: a second add is refused; the merged list has both workers.
    with pytest.raises(aio.AioRpcError) as again:
        await stub.AddWorker(admin.AddWorkerRequest(url=url), timeout=10)
    assert again.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert again.value.details() == f"worker {added.address} is already registered"
    listed = await stub.ListWorkers(admin.ListWorkersRequest(), timeout=5)
    assert [w.id for w in listed.workers] == sorted([first.address, added.address])
    # A removal reaches every process too.
    removed = await stub.RemoveWorker(
        admin.RemoveWorkerRequest(worker_id=added.address, drain_timeout=Duration()), timeout=10
    )
    assert removed.drained is True
    for ch in channels.values():
        assert await healthy(ch, "late") is False
    # The watch saw each change once (one process's events, not one per process).
    seen: list[tuple[admin.WorkerEventKind, str, admin.WorkerStatus]] = []
    while not seen or seen[-1][0] != admin.WORKER_EVENT_KIND_REMOVED:
        event = await asyncio.wait_for(watch.read(), WAIT_S)
        seen.append((event.kind, event.worker.id, event.worker.status))
    watch.cancel()
    assert seen == [
        (admin.WORKER_EVENT_KIND_ADDED, added.address, admin.WORKER_STATUS_PENDING),
        (admin.WORKER_EVENT_KIND_STATUS, added.address, admin.WORKER_STATUS_READY),
        (admin.WORKER_EVENT_KIND_STATUS, added.address, admin.WORKER_STATUS_DRAINING),
        (admin.WORKER_EVENT_KIND_REMOVED, added.address, admin.WORKER_STATUS_DRAINING),
    ]


async def test_an_abort_on_one_process_reaches_a_stream_on_the_other(
    sim: Launcher, gateway: Launcher, closing: list[aio.Channel]
) -> None:
    worker = sim("--model", "m", "--token-ms", "50")
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    channels = await per_process(gw)
    closing.extend(channels.values())
    holder, other = channels[0], channels[1]
    await wait_servable(holder, "m")
    stream = sgl_grpc.SglangSchedulerStub(holder).Generate(
        sgl_generate("long", 100), metadata=model_md("m", ABORT_COMPLETES)
    )
    first = await stream.__aiter__().__anext__()
    assert first.HasField("chunk")
    # Both processes see it in flight through the merged admin view.
    ach, admin_api = admin_stub(gw)
    closing.append(ach)
    listed = await admin_api.ListWorkers(admin.ListWorkersRequest(), timeout=5)
    assert [w.inflight for w in listed.workers] == [1]
    reply = await sgl_grpc.SglangSchedulerStub(other).Abort(
        sgl.AbortRequest(request_id="long"), metadata=model_md("m"), timeout=10
    )
    assert reply.success is True
    rest, error = await collect(stream)
    assert error is None and rest[-1].complete.finish_reason == "abort"
    assert len(rest) < 99
    unknown = await sgl_grpc.SglangSchedulerStub(other).Abort(
        sgl.AbortRequest(request_id="nobody"), metadata=model_md("m"), timeout=10
    )
    assert unknown.success is False
    assert unknown.message == "request 'nobody' is not in flight here"
    aborts = [e for e in request_events(gw.log_path, "Abort") if e["request_id"] == "long"]
    assert [(e["process"], e["targets"]) for e in aborts] == [("1", ["sibling process"])]


async def test_sigterm_drains_both_processes_and_exits_0(
    sim: Launcher, gateway: Launcher, closing: list[aio.Channel], strict: bool
) -> None:
    """Both processes say NOT_SERVING within their drain delay, on the connections they
    hold: a HealthCheck answered `not healthy` (after the delay a call is refused, which
    fails `healthy`), within 0.5 s in the timing tier; their streams end normally."""
    worker = sim("--model", "m", "--token-ms", "40")
    delay_s = 0.5 if strict else 2.0  # room for a busy machine's slow answers
    gw = gateway(
        *PROCESSES,
        "--drain-delay",
        str(delay_s),
        "--worker",
        worker_url(worker, model="m", runtime="sglang"),
    )
    channels = await per_process(gw)
    closing.extend(channels.values())
    run_alone()
    streams = []
    for index, ch in sorted(channels.items()):
        await wait_servable(ch, "m")
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(f"drain-{index}", 40), metadata=model_md("m")
        )
        await call.__aiter__().__anext__()
        streams.append(call)
    terminated = time.monotonic()
    gw.process.send_signal(signal.SIGTERM)
    for ch in channels.values():
        deadline = time.monotonic() + WAIT_S
        while await healthy(ch, "m"):
            assert time.monotonic() < deadline
            await asyncio.sleep(POLL_S / 5)
    if strict:
        assert time.monotonic() - terminated < delay_s
    for call in streams:
        rest, error = await collect(call)
        assert error is None and len(rest) == 40
        assert rest[-1].complete.finish_reason != "abort"
    assert gw.process.wait(timeout=STOP_S) == 0


async def test_a_killed_serving_process_is_soon_replaced_and_serving(
    sim: Launcher, gateway: Launcher, closing: list[aio.Channel], strict: bool
) -> None:
    """Restarted after the first backoff (the supervisor logs it) and serving again:
    within 2 s of the kill in the timing tier; else within twice the gateway's own start
    (a supervisor and two processes, measured here) plus a second, which a busy
    machine stretches alike and a longer backoff would still exceed on an idle one."""
    worker = sim("--model", "m")
    launched = time.monotonic()
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    bound_s = 2.0 if strict else 2 * (time.monotonic() - launched) + 1.0
    before = serving_processes(gw)
    assert len(before) == 2
    run_alone()
    killed = time.monotonic()
    os.kill(before[0], signal.SIGKILL)
    # Replaced: a new pid, listening, counted by the supervisor.
    while True:
        now = serving_processes(gw)
        if len(now) == 2 and before[0] not in now and scrape(gw)["gateway_serving_processes"] == 2:
            break
        assert time.monotonic() - killed < bound_s, f"not replaced within {bound_s:.1f} s: {now}"
        await asyncio.sleep(POLL_S)
    channels = await per_process(gw)
    closing.extend(channels.values())
    for ch in channels.values():
        await wait_servable(ch, "m", within_s=max(0.1, bound_s - (time.monotonic() - killed)))
    assert time.monotonic() - killed < bound_s + 0.5  # finding both connections adds a little
    samples = scrape(gw)
    assert sum(v for k, v in samples.items() if k.startswith("gateway_process_restarts_total")) == 1
    lines = [json.loads(line) for line in gw.log_path.read_text().splitlines()]
    exited = [e for e in lines if e["event"] == "serving_process_exited"]
    assert [(e["process"], e["serving_process"], e["code"]) for e in exited] == [
        ("supervisor", "0", -9)
    ]
    assert exited[0]["restart_in_s"] <= FIRST_BACKOFF_S  # 0: it had run STABLE_S
    assert [e["restarts"] for e in lines if e["event"] == "serving_process_restarted"] == [1]


def test_a_bad_file_is_one_line_before_any_process_starts(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    result = _serve_to_exit("--tls-cert", missing, "--tls-key", missing)
    assert result.returncode == 2
    assert (
        result.stderr == f"gateway: config error: tls.key {missing!r}: No such file or directory\n"
    )


def test_a_process_that_cannot_start_fails_the_supervisor(tmp_path: Path) -> None:
    # Control sockets live in a private directory under TMPDIR: one too deep for a Unix
    # socket path (108 bytes) keeps every serving process from listening.
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    result = _serve_to_exit(env={"TMPDIR": str(deep)})
    assert result.returncode == 2
    assert result.stdout == ""
    # One line from each serving process (grpc core's own log lines, written to the same
    # stderr at the same moment, may split a line: count, do not parse lines).
    assert result.stderr.count(f"gateway: cannot listen on unix:{deep}/gateway-") == 2
    assert "serving process 0 did not start: exit status 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_busy_port_is_refused_in_one_line(busy_port: int) -> None:
    result = _serve_to_exit(listen=f"127.0.0.1:{busy_port}")
    assert result.returncode == 2
    assert result.stderr == (
        f"gateway: cannot listen on 127.0.0.1:{busy_port}: Address already in use\n"
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process listens on (with SO_REUSEPORT, which does not let us in)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def _serve_to_exit(
    *args: str, listen: str = "127.0.0.1:0", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gateway", "serve", "--listen", listen]
    command += ["--admin-listen", "127.0.0.1:0", "--metrics-listen", "off", "--processes", "2"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


async def test_serving_processes_drain_and_exit_when_the_supervisor_is_killed(
    sim: Launcher, gateway: Launcher
) -> None:
    worker = sim("--model", "m")
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    serving = serving_processes(gw)
    gw.kill()
    deadline = time.monotonic() + WAIT_S
    while any(alive(pid) for pid in serving):
        assert time.monotonic() < deadline, "serving processes outlived their supervisor"
        await asyncio.sleep(POLL_S)
    # The port is free again: nobody is left listening on it.
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", gw.port)) != 0
