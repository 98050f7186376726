"""Protection with real processes: bounded work per request, faults attributed to whoever
caused them, and the gateway's own concurrency bound. (n over limits.max_choices, refused
at the front: tests/component/test_protection.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import (
    SGL_SERVICE,
    admin_address,
    channel,
    collect,
    list_workers,
    model_md,
    running_on_sim,
    sgl,
    sgl_generate,
    sgl_grpc,
    wait_health,
    wait_running,
    write_config,
)
from gateway_sim.launch import start_many, worker_url
from tests.e2e.stalled import StalledClient
from tests.support.availability import wait_worker
from tests.support.helpers import wait_for_events
from tests.support.launch import Launcher
from tests.support.waits import WAIT_S


async def test_client_deadlines_never_eject_a_worker(sim: Launcher, gateway: Launcher) -> None:
    """1,000 calls whose own short deadline expires while the worker thinks: none of them
    is the worker's fault, so outlier detection stays closed and the next call is served.

    In batches of 100, each on a connection of its own, once the gateway has ended the
    previous batch's calls (ListWorkers: nothing in flight): a connection's cancelled
    streams can still count against the gateway's max_concurrent_streams (256) for a
    while after that, and a batch beside them got REFUSED_STREAM (UNAVAILABLE "RST_STREAM
    ... error code 7") now and then."""
    worker = sim("--model", "m", "--ttft-ms", "5000")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    admin = admin_address(gw)
    codes: list[tuple[grpc.StatusCode, str]] = []

    async def short(stub: sgl_grpc.SglangSchedulerStub, i: int) -> None:
        call = stub.Generate(sgl_generate(f"d-{i}"), metadata=model_md("m"), timeout=0.05)
        _, error = await collect(call)
        assert error is not None
        codes.append((error.code(), error.details() or ""))

    for batch in range(10):
        async with own_connection(gw.address) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            await asyncio.gather(*(short(stub, batch * 100 + i) for i in range(100)))
        await wait_worker(admin, worker.address, lambda w: w.inflight == 0)
    assert len(codes) == 1000
    assert {code for code, _ in codes} == {grpc.StatusCode.DEADLINE_EXCEEDED}, set(codes)
    async with channel(gw.address) as ch:
        fast = model_md("m", ("x-sim-ttft-ms", "0"))
        stub = sgl_grpc.SglangSchedulerStub(ch)
        messages, error = await collect(stub.Generate(sgl_generate("after"), metadata=fast))
        assert error is None and len(messages) == 5
    listed = (await list_workers(admin))[worker.address]
    assert listed.breaker_state == admin_pb.BREAKER_STATE_CLOSED


def own_connection(address: str) -> aio.Channel:
    """A channel on a connection of its own (grpc shares one between channels to the same
    address with the same options, in its global subchannel pool)."""
    return aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.mark.sim_processes  # SIGSTOP
async def test_calls_on_a_frozen_worker_fail_over_within_keepalive(
    sim: Launcher, gateway: Launcher, tmp_path: Path, strict: bool
) -> None:
    """SIGSTOP a worker while calls wait for their first token on it: keepalive closes
    its connection after keepalive time + timeout, and those calls, which relayed
    nothing yet, are retried on the other worker (all within 20 s in the timing tier;
    else within WAIT_S: without the failover they would wait for the worker forever)."""
    frozen, other = start_many(sim, ("--model", "m"), ("--model", "m"))
    config = write_config(tmp_path, {"upstream": {"keepalive_time_s": 1, "keepalive_timeout_s": 2}})
    gw = gateway(
        "--config",
        config,
        "--worker",
        worker_url(frozen, model="m", runtime="sglang"),
        "--worker",
        worker_url(other, model="m", runtime="sglang"),
    )
    await wait_health(gw.address, "m")
    thinking = model_md("m", ("x-sim-ttft-ms", "3000"))
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        calls = [
            asyncio.ensure_future(collect(stub.Generate(sgl_generate(f"f-{i}"), metadata=thinking)))
            for i in range(4)
        ]
        for worker in (frozen, other):  # placed (round robin: two on each), none answered yet
            assert await wait_running(worker.address, 2) == 2
        started = time.monotonic()
        os.kill(frozen.process.pid, signal.SIGSTOP)
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls), WAIT_S)
            elapsed = time.monotonic() - started
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)
    assert all(error is None and len(messages) == 5 for messages, error in results)
    if strict:
        assert elapsed < 20
    events = wait_for_events(gw.log_path, 4, rpc="Generate")
    moved = [e for e in events if e["retries"] == 1]
    assert len(moved) == 2
    assert all(e["legs"] == {"regular": [frozen.address, other.address]} for e in moved)


async def test_an_idle_client_connection_is_closed(
    sim: Launcher, gateway: Launcher, tmp_path: Path, strict: bool
) -> None:
    """Idle connections are not held forever: one with no call for
    `limits.connection_idle_timeout_s` gets GOAWAY (not before it; within 5 s of the
    call in the timing tier), and the client's channel goes idle."""
    worker = sim("--model", "m")
    config = write_config(tmp_path, {"limits": {"connection_idle_timeout_s": 1}})
    gw = gateway("--config", config, "--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        started = time.monotonic()  # the idle time starts after this, as the call ends
        messages, error = await collect(
            sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("m"))
        )
        assert error is None and len(messages) == 5
        assert ch.get_state() is grpc.ChannelConnectivity.READY
        async with asyncio.timeout(WAIT_S):
            state = ch.get_state()
            while state is grpc.ChannelConnectivity.READY:
                await ch.wait_for_state_change(state)
                state = ch.get_state()
        assert state is grpc.ChannelConnectivity.IDLE
        assert time.monotonic() - started > 0.5
        if strict:
            assert time.monotonic() - started < 5


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def generated_by(address: str) -> int:
    """Tokens the simulated worker's running calls have produced (its own GetLoads)."""
    async with channel(address) as ch:
        loads = await sgl_grpc.SglangSchedulerStub(ch).GetLoads(sgl.GetLoadsRequest(), timeout=2)
    return sum(load.num_used_tokens for load in loads.loads)


@pytest.mark.sim_processes  # a worker busy on a core of its own
async def test_clients_that_stop_reading_stall_the_worker_not_the_gateway(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """Streams of 1M tokens whose client never grants window: the worker is paused by
    flow control through the gateway, and the gateway's memory stays flat.

    The issue's case was 20 streams of 200k tokens; filling their windows took the sim
    some 8 s of token production (25k tokens/s unloaded, 7k/s measured in the suite),
    up to 38 s in a full run. Here 5 streams and the gateway's upstream stream window
    at 64 KiB (`upstream.stream_window_bytes`, default 256 KiB): the same backpressure
    per stream, a tenth of the tokens to fill. A gateway that buffered instead would
    let the count run on (up to 1M tokens a stream) far past the window bound. The count
    is sampled every 0.25 s and called paused once it has not moved for 2 s (a filling
    sim adds hundreds in any 0.25 s), then must stay put for 2 s more."""
    streams = 5
    worker = sim("--model", "m", "--tokens", "1000000", "--max-model-len", "2000000")
    config = write_config(tmp_path, {"upstream": {"stream_window_bytes": 64 * 1024}})
    gw = gateway("--config", config, "--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    before = rss_mib(gw.process.pid)
    client = StalledClient("127.0.0.1", gw.port)
    request = sgl_generate("stalled", tokens=1_000_000).SerializeToString()
    await client.open(f"/{SGL_SERVICE}/Generate", request, {"x-model-id": "m"}, streams=streams)
    try:
        for _ in range(100):  # bounded: until all of them run on the worker
            if await running_on_sim(worker.address) == streams:
                break
            await asyncio.sleep(0.1)
        # The windows fill (gateway <- worker: 64 KiB a stream; client <- gateway: 64 KiB),
        # then the worker stops: the count has not moved for 2 s. Bounded (40 s); on a
        # gateway without backpressure the count keeps growing far past this.
        previous, paused = -1, None
        steady_since = time.monotonic()
        deadline = steady_since + 40
        while time.monotonic() < deadline:
            produced = await generated_by(worker.address)
            if produced != previous:
                previous, steady_since = produced, time.monotonic()
            elif time.monotonic() - steady_since >= 2.0:
                paused = produced
                break
            await asyncio.sleep(0.25)
        assert paused is not None, f"the worker never paused ({previous} tokens)"
        await asyncio.sleep(2)
        still = await generated_by(worker.address)
        grown = rss_mib(gw.process.pid) - before
    finally:
        await client.close()
    assert still == paused  # nothing produced while the client does not read
    # At most the windows' worth (2 x 64 KiB) of 25-byte messages per stream (~5,200),
    # not 1M tokens.
    assert 0 < paused < streams * 6_000
    assert grown < 64, f"gateway RSS grew {grown:.1f} MiB"
    assert client.ended == 0
