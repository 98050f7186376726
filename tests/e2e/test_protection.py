"""Protection with real processes: bounded work per request, faults attributed to whoever
caused them, and the gateway's own concurrency bound."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from gateway.admin.v1 import admin_pb2 as admin_pb
from tests.conftest import Launcher, run_alone, worker_url
from tests.e2e.availability_helpers import admin_address, list_workers
from tests.e2e.helpers import (
    SGL_SERVICE,
    assert_verdict,
    channel,
    collect,
    model_md,
    rich_status,
    running_on_sim,
    sgl,
    sgl_generate,
    sgl_grpc,
    start_many,
    wait_for_events,
    wait_health,
    write_config,
)
from tests.e2e.stalled import StalledClient
from tests.e2e.test_disagg import pd_urls


async def test_n_over_max_choices_is_refused_at_once_and_others_are_served(
    sim: Launcher, gateway: Launcher
) -> None:
    """n = 2^32-1 on a PD model used to split into that many prefill + decode pairs and
    stop the event loop; now it is INVALID_ARGUMENT before anything goes upstream, while
    a concurrent call to another model streams on."""
    prefill, decode, regular = start_many(
        sim,
        ("--role", "prefill", "--model", "m"),
        ("--role", "decode", "--model", "m"),
        ("--model", "other", "--token-ms", "5"),
    )
    gw = gateway(
        *pd_urls(prefill, decode),
        "--worker",
        worker_url(regular, model="other", runtime="sglang"),
    )
    await wait_health(gw.address, "m")
    await wait_health(gw.address, "other")
    run_alone()
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        other = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("o-1", tokens=40), metadata=model_md("other")))
        )
        started = time.monotonic()
        _, error = await collect(
            stub.Generate(sgl_generate("huge", n=2**32 - 1), metadata=model_md("m"))
        )
        elapsed = time.monotonic() - started
        messages, other_error = await other
    assert elapsed < 1.0
    assert error is not None
    message = (
        "sampling_params.n = 4294967295 is over this gateway's limit of 16 (limits.max_choices)"
    )
    assert_verdict(
        error,
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_OVER_LIMIT",
        message,
        {
            "model": "",
            "leg": "",
            "httpStatus": "400",
            "code": "request_over_limit",
            "field": "sampling_params.n",
            "limit": "16",
        },
    )
    _, details = rich_status(error)
    (violation,) = details["BadRequest"].field_violations
    assert (violation.field, violation.description) == (
        "sampling_params.n",
        "must be at most 16 (limits.max_choices)",
    )
    assert other_error is None and len(messages) == 41


async def test_client_deadlines_never_open_a_breaker(sim: Launcher, gateway: Launcher) -> None:
    """1,000 calls whose own short deadline expires while the worker thinks: none of them
    is the worker's fault, so its breaker stays closed and the next call is served."""
    worker = sim("--model", "m", "--ttft-ms", "5000")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    codes: list[grpc.StatusCode] = []
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)

        async def short(i: int) -> None:
            call = stub.Generate(sgl_generate(f"d-{i}"), metadata=model_md("m"), timeout=0.05)
            _, error = await collect(call)
            assert error is not None
            codes.append(error.code())

        for batch in range(10):
            await asyncio.gather(*(short(batch * 100 + i) for i in range(100)))
        assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED} and len(codes) == 1000
        fast = model_md("m", ("x-sim-ttft-ms", "0"))
        messages, error = await collect(stub.Generate(sgl_generate("after"), metadata=fast))
        assert error is None and len(messages) == 5
    listed = (await list_workers(admin_address(gw)))[worker.address]
    assert listed.breaker_state == admin_pb.BREAKER_STATE_CLOSED


@pytest.mark.sim_processes  # SIGSTOP
async def test_calls_on_a_frozen_worker_fail_over_within_keepalive(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """SIGSTOP a worker while calls wait for their first token on it: keepalive closes
    its connection after keepalive time + timeout, and those calls, which relayed
    nothing yet, are retried on the other worker."""
    frozen, other = start_many(sim, ("--model", "m"), ("--model", "m"))
    config = write_config(tmp_path, {"upstream": {"keepalive_time_s": 2, "keepalive_timeout_s": 2}})
    gw = gateway(
        "--config",
        config,
        "--worker",
        worker_url(frozen, model="m", runtime="sglang"),
        "--worker",
        worker_url(other, model="m", runtime="sglang"),
    )
    await wait_health(gw.address, "m")
    thinking = model_md("m", ("x-sim-ttft-ms", "1500"))
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        calls = [
            asyncio.ensure_future(collect(stub.Generate(sgl_generate(f"f-{i}"), metadata=thinking)))
            for i in range(4)
        ]
        await asyncio.sleep(0.3)  # placed (round robin: two on each), none answered yet
        started = time.monotonic()
        os.kill(frozen.process.pid, signal.SIGSTOP)
        try:
            results = await asyncio.gather(*calls)
            elapsed = time.monotonic() - started
        finally:
            os.kill(frozen.process.pid, signal.SIGCONT)
    assert all(error is None and len(messages) == 5 for messages, error in results)
    assert elapsed < 20
    events = wait_for_events(gw.log_path, 4, rpc="Generate")  # type: ignore[attr-defined]
    moved = [e for e in events if e["retries"] == 1]
    assert len(moved) == 2
    assert all(e["legs"] == {"regular": [frozen.address, other.address]} for e in moved)


async def test_an_idle_client_connection_is_closed(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """Idle connections are not held forever: one with no call for
    `limits.connection_idle_timeout_s` gets GOAWAY, and the client's channel goes idle."""
    worker = sim("--model", "m")
    config = write_config(tmp_path, {"limits": {"connection_idle_timeout_s": 1}})
    gw = gateway("--config", config, "--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        messages, error = await collect(
            sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("m"))
        )
        assert error is None and len(messages) == 5
        assert ch.get_state() is grpc.ChannelConnectivity.READY
        started = time.monotonic()
        async with asyncio.timeout(10):
            state = ch.get_state()
            while state is grpc.ChannelConnectivity.READY:
                await ch.wait_for_state_change(state)
                state = ch.get_state()
        assert state is grpc.ChannelConnectivity.IDLE
        assert 0.5 < time.monotonic() - started < 5


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
    sim: Launcher, gateway: Launcher
) -> None:
    """20 streams of 200k tokens whose client never grants window: the worker is paused
    by flow control through the gateway, and the gateway's memory stays flat.

    Filling the windows takes the sim some 8 s of token production (~25k tokens/s); the
    count is sampled every 0.25 s and called paused once it has not moved for 2 s (a
    filling sim adds thousands in any 0.25 s), then must stay put for 3 s more."""
    worker = sim("--model", "m", "--tokens", "200000")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    before = rss_mib(gw.process.pid)
    client = StalledClient("127.0.0.1", gw.port)
    request = sgl_generate("stalled", tokens=200_000).SerializeToString()
    await client.open(f"/{SGL_SERVICE}/Generate", request, {"x-model-id": "m"}, streams=20)
    try:
        for _ in range(100):  # bounded: until all 20 run on the worker
            if await running_on_sim(worker.address) == 20:
                break
            await asyncio.sleep(0.1)
        # The windows fill (gateway <- worker: 256 KiB a stream; client <- gateway: 64 KiB),
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
        await asyncio.sleep(3)
        still = await generated_by(worker.address)
        grown = rss_mib(gw.process.pid) - before
    finally:
        await client.close()
    assert still == paused  # nothing produced while the client does not read
    # At most a stream window's worth of 25-byte messages per stream, not 200k tokens.
    assert 0 < paused < 20 * 20_000
    assert grown < 64, f"gateway RSS grew {grown:.1f} MiB"
    assert client.ended == 0
