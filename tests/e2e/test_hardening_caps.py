"""Hardening with real processes, against callers that take too much: one caller cannot take
every slot, connections past the cap (overall and one peer's) are refused or closed and
logged, health watches past the cap are refused while calls are served, and twenty long
prompts do not stall another model's calls."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    list_workers,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    write_config,
)
from gateway_sim.launch import START_S, Child, ready, worker_url
from tests.e2e.rawclient import RawClient
from tests.support.availability import samples, scrape
from tests.support.hardening import assert_served, model_m_gateway
from tests.support.helpers import assert_verdict
from tests.support.launch import Launcher
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S, until


def start_sink() -> Child:
    """A worker that holds Generate calls without reading them (tests/e2e/sink_worker)."""
    args = [sys.executable, "-m", "tests.e2e.sink_worker"]
    return ready(subprocess.Popen(args, stdout=subprocess.PIPE, text=True), args, START_S)


async def test_one_caller_cannot_take_every_slot(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """Caller alice holds her share of streams on a stalled worker; her next call is
    CALLER_OVER_SHARE, while bob's calls to another model still succeed."""
    stalled = sim("--model", "m", "--ttft-ms", "60000")
    other = sim("--model", "other")
    keys = tmp_path / "keys"
    keys.write_text("alice:alice-key-0123456789\nbob:bob-key-01234567890\n")
    config = write_config(
        tmp_path,
        {
            "auth": {"api_keys_file": str(keys)},
            "limits": {"max_inflight_requests": 40, "max_inflight_per_principal": 20},
        },
    )
    gw = gateway(
        "--config",
        config,
        "--worker",
        worker_url(stalled, model="m", runtime="sglang"),
        "--worker",
        worker_url(other, model="other", runtime="sglang"),
    )
    alice = ("authorization", "Bearer alice-key-0123456789")
    bob = ("authorization", "Bearer bob-key-01234567890")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)

        async def both_ready() -> bool:
            for model in ("m", "other"):
                reply = await stub.HealthCheck(
                    sgl.HealthCheckRequest(), metadata=model_md(model, bob), timeout=2
                )
                if not reply.healthy:
                    return False
            return True

        await until(both_ready, 20)
        held = [
            stub.Generate(sgl_generate(f"a{i}"), metadata=model_md("m", alice)) for i in range(20)
        ]
        try:
            await asyncio.sleep(0)

            async def alice_full() -> bool:
                _, error = await collect(
                    stub.Generate(sgl_generate("a-more"), metadata=model_md("m", alice))
                )
                return error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

            await until(alice_full, 10)
            _, error = await collect(
                stub.Generate(sgl_generate("a-more"), metadata=model_md("m", alice))
            )
            assert error is not None
            assert_verdict(
                error,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "CALLER_OVER_SHARE",
                "This caller (key:alice) already has 20 requests in flight, its share of "
                "this gateway (limits.max_inflight_per_principal)",
                {"model": "", "leg": "", "httpStatus": "429", "code": "caller_over_share"},
                retry_s=1,
                pushback_ms=1000,
            )
            for i in range(20):
                messages, error = await collect(
                    stub.Generate(sgl_generate(f"b{i}"), metadata=model_md("other", bob))
                )
                assert error is None and len(messages) == 5
        finally:
            for call in held:
                call.cancel()


async def test_connections_past_the_cap_are_refused_and_logged_then_served_again(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    gw = await model_m_gateway(sim, gateway, tmp_path, {"max_connections": 20})
    idle: list[RawClient] = []
    try:
        # 20 connections, every one held by a server transport (its SETTINGS came): at
        # the cap. The readiness checks' own connections may still count for a moment as
        # they close, so a connection the server did not take is replaced (bounded).
        for _ in range(5):
            while len(idle) < 20:
                client = RawClient("127.0.0.1", gw.port)
                await client.connect()
                idle.append(client)
            greetings = {asyncio.ensure_future(c.greeted.wait()): c for c in idle}
            _, waiting = await asyncio.wait(greetings, timeout=WAIT_S / 5)
            for pending in waiting:
                pending.cancel()
                await greetings[pending].close()
                idle.remove(greetings[pending])
            if not waiting:
                break
        assert len(idle) == 20 and all(c.greeted.is_set() for c in idle)
        async with channel(gw.address) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            with_deadline = stub.Generate(sgl_generate("late"), metadata=model_md("m"), timeout=1)
            _, error = await collect(with_deadline)
        assert error is not None
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        log_path: Path = gw.log_path

        async def logged() -> bool:
            text = await asyncio.to_thread(log_path.read_text)
            return '"connection_limit_reached"' in text

        await until(logged, 10)
    finally:
        for client in idle:
            await client.close()

    async def served() -> bool:  # once the gateway has seen them close (a fresh channel)
        async with channel(gw.address) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            call = stub.Generate(sgl_generate("ok"), metadata=model_md("m"), timeout=2)
            messages, error = await collect(call)
        return error is None and len(messages) == 5

    await until(served, 10, every_s=0.2)


@pytest.mark.sim_processes  # latency measured
@pytest.mark.timeout(240)  # 40 s on a busy machine, and run_alone() waits for the others
async def test_twenty_long_prompts_do_not_stall_another_models_calls(
    sim: Launcher, gateway: Launcher, tmp_path: Path, processes: list[Child], strict: bool
) -> None:
    """20 concurrent 1M-token prompts to a cache_aware model (from another process and
    principal) while a small call to another model repeats: the small call's slowest is
    within 100 ms of its unloaded slowest in the timing tier (it used to stall 5.5 s);
    else within ten times that plus a second (a machine busy with other work stretches
    the decoding and hashing of 20 MB of tokens to some 0.5 s of stall). The sender runs at
    nice 19: it stands for clients on other machines, and its own CPU (serializing 60 MB)
    is not the gateway's to answer for on a 2-core box. Measured here: 25-40 ms. The
    small calls repeat from the sending until the gateway has placed all 20 prompts (it
    has nothing more to do for them then), not for a fixed 4 s."""
    held = start_sink()
    processes.append(held)
    other = sim("--model", "b")
    keys = tmp_path / "keys"
    keys.write_text("bulk:bulk-key-0123456789\nprobe:probe-key-012345678\n")
    config = write_config(
        tmp_path,
        {"auth": {"api_keys_file": str(keys)}, "models": {"a": {"policy": "cache_aware"}}},
    )
    gw = gateway(
        "--config",
        config,
        "--worker",
        worker_url(held, model="a", runtime="sglang"),
        "--worker",
        worker_url(other, model="b", runtime="sglang"),
    )
    probe = model_md("b", ("authorization", "Bearer probe-key-012345678"))
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)

        async def small() -> float:
            started = time.perf_counter()
            messages, error = await collect(
                stub.Generate(sgl_generate("small", tokens=1), metadata=probe, timeout=10)
            )
            assert error is None and len(messages) == 2
            return time.perf_counter() - started

        async def b_ready() -> bool:
            _, error = await collect(stub.Generate(sgl_generate("w", tokens=1), metadata=probe))
            return error is None

        await until(b_ready, 20)
        sender = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "tests.e2e.long_prompts_sender", gw.address, "a"),
            *("bulk-key-0123456789", "1000000", "20"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert sender.stdin is not None and sender.stdout is not None
            # Its start-up (Python, numpy, a 1M-token request) before the test runs alone.
            assert await asyncio.wait_for(sender.stdout.readline(), 60) == b"ready\n"
            run_alone()
            unloaded = [await small() for _ in range(20)]
            sender.stdin.write(b"go\n")
            await sender.stdin.drain()
            assert await asyncio.wait_for(sender.stdout.readline(), 60) == b"sent\n"
            # Measured from the sending to the placing of the last long prompt: every one
            # was decoded, hashed and placed within the window (bounded: 30 s).
            loaded = []
            started = time.monotonic()
            while (await list_workers(admin_address(gw)))[held.address].inflight < 20:
                assert time.monotonic() - started < 30, "the long prompts were not placed"
                loaded.append(await small())
            loaded.append(await small())
        finally:
            sender.kill()  # its calls end with its connection
            await sender.wait()
    slowest, base = max(loaded), max(unloaded)
    print(f"small call: unloaded max {base * 1000:.1f} ms, loaded max {slowest * 1000:.1f} ms")
    assert slowest <= (base + 0.1 if strict else 10 * base + 1.0)


async def test_health_watches_past_the_cap_are_refused_and_calls_are_served(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """2,000 health Watch streams (8 connections from 127.0.0.2): at most the watch cap
    (max_concurrent_streams x 4 = 1,024) stay open, the rest are RESOURCE_EXHAUSTED (or
    shed by grpc core while thousands arrive at once); a normal call is served meanwhile.
    (The issue's flood was 10,000: twice the cap makes the same point, in a fifth of the
    time; a gateway without the cap would keep all 2,000 open.)"""
    total = 2_000
    gw = await model_m_gateway(sim, gateway, tmp_path)
    watch = "/grpc.health.v1.Health/Watch"
    clients = [RawClient("127.0.0.1", gw.port, source="127.0.0.2") for _ in range(total // 250)]
    try:
        for client in clients:
            await client.connect()
            for _ in range(250):
                client.open(watch, [], b"")
        streams = [s for c in clients for s in c.streams.values()]

        async def settled() -> bool:  # every stream refused, or sent its first status
            return all(s.ended.is_set() or s.data for s in streams)

        await until(settled, 30, every_s=0.2)
        await assert_served(gw)
        open_watches = [s for s in streams if not s.ended.is_set()]
        refused = [s for s in streams if s.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
        cancelled = grpc.StatusCode.CANCELLED.value[0]
        shed = [s for s in streams if s.status in (None, cancelled) and s.ended.is_set()]
        assert 0 < len(open_watches) <= 1024
        assert len(open_watches) + len(refused) + len(shed) == total
        assert refused and refused[0].message == "too many health watches"
    finally:
        for client in clients:
            await client.close()


async def test_one_peers_connections_past_its_cap_are_closed_and_logged(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """grpc core has no per-peer bound: the gateway's connection watch closes a peer's
    newest connections past `max_connections_per_peer`, logs it once, and other peers are
    served as before."""
    gw = await model_m_gateway(sim, gateway, tmp_path, {"max_connections_per_peer": 5})
    crowd = [RawClient("127.0.0.1", gw.port, source="127.0.0.2") for _ in range(12)]

    def counted(expected: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            text = await asyncio.to_thread(scrape, gw)
            return samples(text, "gateway_client_connections")[frozenset()] == expected

        return check

    try:
        await until(counted(0), 10, every_s=0.1)  # the readiness check's connection is gone
        for client in crowd[:5]:
            await client.connect()
        await until(counted(5), 10, every_s=0.1)  # the watch has seen the first five
        for client in crowd[5:]:
            await client.connect()

        async def trimmed() -> bool:
            return sum(c.closed.is_set() for c in crowd) == 7

        await until(trimmed, 10, every_s=0.1)
        assert all(not c.closed.is_set() for c in crowd[:5])  # the oldest five stay
        log_path: Path = gw.log_path

        async def limit_lines() -> list[str]:
            text = await asyncio.to_thread(log_path.read_text)
            return [line for line in text.splitlines() if "connection_per_peer_limit" in line]

        async def logged() -> bool:  # the watch logs once it has closed them
            return bool(await limit_lines())

        await until(logged, 10, every_s=0.1)
        lines = await limit_lines()
        assert len(lines) == 1 and '"peer": "127.0.0.2"' in lines[0]
        closed = samples(
            await asyncio.to_thread(scrape, gw), "gateway_client_connections_closed_per_peer_total"
        )
        assert closed[frozenset()] == 7
        await assert_served(gw)
    finally:
        for client in crowd:
            await client.close()
