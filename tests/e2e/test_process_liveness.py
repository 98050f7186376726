"""`gateway serve --processes 2` when a serving process wedges, when SIGHUPs arrive, and
when the supervisor is killed outright. Real processes on loopback.

A SIGSTOPped process is the wedged one: it holds its connections and its control socket
but answers nothing, exactly as a process whose event loop is stuck.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin
from gateway.scale.control import READ_TIMEOUT_S
from gateway.scale.supervisor import LIVENESS_INTERVAL_S, LIVENESS_MISSES, LIVENESS_TIMEOUT_S
from gateway_sim.client import POLL_S, collect, model_md, sgl_generate, sgl_grpc
from gateway_sim.launch import Child, worker_url
from tests.support.launch import STOP_S, Launcher
from tests.support.processes import (
    PROCESSES,
    admin_stub,
    alive,
    per_process,
    scrape,
    serving_processes,
    wait_servable,
)
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S

# The slowest a check can notice: a full interval, then LIVENESS_MISSES deadlines.
NOTICED_WITHIN_S = LIVENESS_INTERVAL_S + LIVENESS_MISSES * LIVENESS_TIMEOUT_S
REPLACED_WITHIN_S = 10.0  # the timing tier's bound: noticed, then a process's start
assert NOTICED_WITHIN_S + 2.0 <= REPLACED_WITHIN_S


@pytest.fixture
async def closing() -> AsyncIterator[list[aio.Channel]]:
    channels: list[aio.Channel] = []
    yield channels
    for ch in channels:
        await ch.close()


def launch_file(pid: int) -> Path:
    """The launch file a serving process was started with (`... gateway.scale.child FILE`)."""
    words = [w for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if w]
    return Path(words[-1].decode())


def log_lines(gw: Child) -> list[dict[str, Any]]:
    lines = []
    for line in gw.log_path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line of grpc core's own on the shared stderr
    return lines


def restarts(gw: Child) -> float:
    samples = scrape(gw)
    return sum(v for k, v in samples.items() if k.startswith("gateway_process_restarts_total"))


async def test_a_stopped_serving_process_is_replaced_and_admin_answers_meanwhile(
    sim: Launcher, gateway: Launcher, closing: list[aio.Channel], strict: bool
) -> None:
    """Replaced within 10 s (timing tier), else within the time to notice plus twice the
    gateway's own start (measured here) and a second; meanwhile every admin read answers
    within its per-process deadline plus 1 s (timing tier), else plus twice what a read
    took before the stop, and a second."""
    worker = sim("--model", "m")
    launched = time.monotonic()
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    started_s = time.monotonic() - launched
    replaced_within_s = REPLACED_WITHIN_S if strict else NOTICED_WITHIN_S + 2 * started_s + 1.0
    before = serving_processes(gw)
    assert len(before) == 2
    victim = before[0]
    index = int(launch_file(victim).stem.removeprefix("p"))
    ach, stub = admin_stub(gw)
    closing.append(ach)
    await stub.ListWorkers(admin.ListWorkersRequest(), timeout=5)
    asked = time.monotonic()
    await stub.ListWorkers(admin.ListWorkersRequest(), timeout=5)
    answer_s = 0.0 if strict else 2 * (time.monotonic() - asked)
    run_alone()
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        # Meanwhile the admin API answers, each call within its per-process deadline,
        # from the process that answers.
        waits = []
        while True:
            asked = time.monotonic()
            listed = await stub.ListWorkers(admin.ListWorkersRequest(), timeout=10)
            waits.append(time.monotonic() - asked)
            assert [w.id for w in listed.workers] == [worker.address]
            now = serving_processes(gw)
            if victim not in now and len(now) == 2:
                break
            assert time.monotonic() - stopped < replaced_within_s, f"not replaced: {now}"
            await asyncio.sleep(POLL_S)
        assert waits[0] >= READ_TIMEOUT_S * 0.9  # the stopped process was asked, and waited for
        assert max(waits) < READ_TIMEOUT_S + 1.0 + answer_s
        # Replaced: the new process listens (the supervisor reaches it).
        while scrape(gw)["gateway_serving_processes"] != 2:
            assert time.monotonic() - stopped < replaced_within_s, "the new process is not up"
            await asyncio.sleep(POLL_S)
        assert restarts(gw) == 1
    finally:
        if alive(victim):  # SIGKILL ends a stopped process too; the supervisor reaps it
            os.kill(victim, signal.SIGKILL)
    # Every new connection is served again: both processes answer.
    channels = await per_process(gw)
    closing.extend(channels.values())
    for ch in channels.values():
        await wait_servable(ch, "m")
    lines = log_lines(gw)
    unresponsive = [e for e in lines if e["event"] == "serving_process_unresponsive"]
    assert [(e["process"], e["serving_process"], e["pid"]) for e in unresponsive] == [
        ("supervisor", str(index), victim)
    ]
    exited = [e for e in lines if e["event"] == "serving_process_exited"]
    assert [(e["serving_process"], e["code"]) for e in exited] == [(str(index), -9)]
    assert gw.stop(STOP_S) == 0


async def test_sighups_to_the_supervisor_end_no_stream_and_restart_no_process(
    sim: Launcher, gateway: Launcher, closing: list[aio.Channel]
) -> None:
    worker = sim("--model", "m", "--token-ms", "20")
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    before = serving_processes(gw)
    channels = await per_process(gw)
    closing.extend(channels.values())
    tokens = 100  # 2 s of stream, longer than the SIGHUPs take
    streams = []
    for index, ch in sorted(channels.items()):
        await wait_servable(ch, "m")
        for n in range(3):
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_generate(f"hup-{index}-{n}", tokens), metadata=model_md("m")
            )
            await call.__aiter__().__anext__()  # in flight
            streams.append(call)
    for _ in range(10):
        gw.process.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.1)
    for call in streams:
        rest, error = await collect(call)
        assert error is None and len(rest) == tokens
        assert rest[-1].complete.finish_reason != "abort"
    assert gw.process.poll() is None
    assert serving_processes(gw) == before
    assert scrape(gw)["gateway_serving_processes"] == 2 and restarts(gw) == 0
    lines = log_lines(gw)
    assert not [e for e in lines if e["event"] == "serving_process_exited"]
    reloaded = {e["process"] for e in lines if e["event"] == "reloaded"}
    assert reloaded == {"0", "1"}  # each serving process got them, and lived
    assert gw.stop(STOP_S) == 0


async def test_a_killed_supervisors_directory_is_removed_by_its_last_serving_process(
    sim: Launcher, gateway: Launcher
) -> None:
    worker = sim("--model", "m")
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    serving = serving_processes(gw)
    directory = launch_file(serving[0]).parent
    assert directory.is_dir() and sorted(p.name for p in directory.iterdir()) == [
        "p0.launch",
        "p0.sock",
        "p1.launch",
        "p1.sock",
    ]
    gw.kill()
    deadline = time.monotonic() + WAIT_S
    while any(alive(pid) for pid in serving):
        assert time.monotonic() < deadline, "serving processes outlived their supervisor"
        await asyncio.sleep(POLL_S)
    assert not directory.exists()
    # One SIGTERM each, however many times the kernel signals the supervisor's death: a
    # drain, not a "stop now".
    events = [(e["process"], e["event"]) for e in log_lines(gw)]
    assert sorted(p for p, event in events if event == "draining") == ["0", "1"]
    assert not [p for p, event in events if event == "stopping now: second signal"]


async def test_a_stopped_supervisor_removes_its_directory(sim: Launcher, gateway: Launcher) -> None:
    worker = sim("--model", "m")
    gw = gateway(*PROCESSES, "--worker", worker_url(worker, model="m", runtime="sglang"))
    directory = launch_file(serving_processes(gw)[0]).parent
    assert directory.is_dir()
    assert gw.stop(STOP_S) == 0
    assert not directory.exists()
