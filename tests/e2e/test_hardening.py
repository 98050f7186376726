"""Hardening with real processes: odd header values, requests that never finish arriving,
one caller holding every slot, connections past the cap, SIGHUP without TLS."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    list_workers,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    wait_health,
    write_config,
)
from gateway_sim.launch import START_S, Child, ready, worker_url
from tests.e2e.rawclient import RawClient
from tests.support.availability import samples, scrape
from tests.support.helpers import assert_verdict
from tests.support.launch import Launcher
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S, until

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
BAD_VALUES = {
    "non-ascii": "café".encode(),
    "tab": b"a\tb",
    "cr-lf": b"a\r\nb",
    "nul": b"a\x00b",
    "esc": b"a\x1bb",
    "del": b"a\x7fb",
}


async def model_m_gateway(
    sim: Launcher, gateway: Launcher, tmp_path: Path, limits: Mapping[str, object] | None = None
) -> Child:
    """A gateway (with these `limits`) in front of one simulated worker of model m, ready."""
    worker = sim("--model", "m")
    args = ["--worker", worker_url(worker, model="m", runtime="sglang")]
    if limits:
        args += ["--config", write_config(tmp_path, {"limits": limits})]
    gw = gateway(*args)
    await wait_health(gw.address, "m")
    return gw


async def assert_served(gw: Child) -> None:
    """A normal call to model m, on its own channel, streams its five messages."""
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_generate("good"), metadata=model_md("m"), timeout=5)
        messages, error = await collect(call)
    assert error is None and len(messages) == 5


def start_sink() -> Child:
    """A worker that holds Generate calls without reading them (tests/e2e/sink_worker)."""
    args = [sys.executable, "-m", "tests.e2e.sink_worker"]
    return ready(subprocess.Popen(args, stdout=subprocess.PIPE, text=True), args, START_S)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def details_of(stream_headers: dict[bytes, bytes]) -> tuple[error_details_pb2.ErrorInfo, list[str]]:
    import base64

    raw = stream_headers[b"grpc-status-details-bin"]
    status = status_pb2.Status.FromString(base64.b64decode(raw + b"=" * (-len(raw) % 4)))
    info = error_details_pb2.ErrorInfo()
    fields = []
    for packed in status.details:
        if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            packed.Unpack(info)
        if packed.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            packed.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return info, fields


async def test_bad_header_values_are_refused_at_the_front_and_never_eject_a_worker(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """Each class of value grpc refuses upstream gets INVALID_ARGUMENT BAD_METADATA naming
    the key, before placement. Rounds of 20 bad requests interleaved with good calls: every
    good call succeeds and outlier detection ejects no worker (it used to after 10)."""
    gw = await model_m_gateway(sim, gateway, tmp_path)
    request = sgl_generate("bad").SerializeToString()
    client = RawClient("127.0.0.1", gw.port)
    await client.connect()
    try:
        async with channel(gw.address) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            for _ in range(3):
                streams = []
                for index in range(20):
                    value = list(BAD_VALUES.values())[index % len(BAD_VALUES)]
                    md = [(b"x-model-id", b"m"), (b"x-odd", value)]
                    streams.append(client.open(GENERATE, md, request))
                good = await collect(stub.Generate(sgl_generate("good"), metadata=model_md("m")))
                assert good[1] is None and len(good[0]) == 5
                for stream in streams:
                    await asyncio.wait_for(stream.ended.wait(), 5)
                    if stream.reset:  # grpc core refused the header itself: fine too
                        continue
                    assert stream.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                    assert stream.message.startswith("Metadata 'x-odd' has a value")
                    info, fields = details_of(stream.headers)
                    assert info.reason == "BAD_METADATA"
                    assert info.metadata["key"] == "x-odd"
                    assert fields == ["x-odd"]
                    assert stream.headers[b"x-http-status"] == b"400"
            answered = [s for s in client.streams.values() if not s.reset]
            assert len(answered) >= 40  # most values reach the front: it is what refuses them
        workers = await list_workers(admin_address(gw))
        (state,) = workers.values()
        assert state.breaker_state == admin_pb.BREAKER_STATE_CLOSED
    finally:
        await client.close()


async def test_partial_messages_hold_bounded_memory_and_end_at_the_read_timeout(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """2 connections x 20 streams announce 60 MiB and send 30 MiB: only the reads the gate
    lets run (2 for this peer) take more than a stream window, so RSS stays within bounds
    (grpc core lets a raw client send ~4 MiB ahead on a read stream: 40 unbounded reads
    would hold ~170 MiB); every stream ends at the read timeout; a normal call is served
    meanwhile. The windows fill within a fraction of a second, so a 2 s read timeout
    shows the peak as well as a longer one; RSS is sampled until the streams end."""
    gw = await model_m_gateway(sim, gateway, tmp_path, {"request_read_timeout_s": 2})
    before = rss_mib(gw.process.pid)
    part = b"\0" * (30 * 1024 * 1024)
    clients = [RawClient("127.0.0.1", gw.port) for _ in range(2)]
    peak = before
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, rss_mib(gw.process.pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    try:
        for client in clients:
            await client.connect()
            for _ in range(20):
                client.open(GENERATE, [(b"x-model-id", b"m")], part, announce=60 << 20, end=False)
        async with channel(gw.address) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            good = await collect(stub.Generate(sgl_generate("good"), metadata=model_md("m")))
        assert good[1] is None
        streams = [s for c in clients for s in c.streams.values()]
        for stream in streams:
            await asyncio.wait_for(stream.ended.wait(), 10)
        sampling = False
        await sampler
        assert all(s.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] for s in streams)
        assert all(s.message.startswith("No complete request message within 2 s") for s in streams)
        assert peak - before < 128, f"RSS grew {peak - before:.0f} MiB"
    finally:
        sampling = False
        await sampler
        for client in clients:
            await client.close()

    async def back_down() -> bool:
        return rss_mib(gw.process.pid) < before + 32

    await until(back_down, 10)


async def test_header_only_streams_past_the_share_are_refused_or_ended_by_the_bounds(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """2,500 streams (10 connections from 127.0.0.2) that send headers and never a
    message: each takes an admission slot from its opening, so past the peer's share
    (a quarter of max_inflight_requests) they are CALLER_OVER_SHARE at once, and the read
    timeout ends the rest; a client on 127.0.0.1 is served meanwhile.

    The issue's flood was 10,000 streams against the default 4096 slots (share 1,024);
    here max_inflight_requests is 1,024 (share 256, the same quarter) and the flood 2,500
    streams: still ten times the share, so a gateway that admitted streams only once
    their message arrived (or had no share) would let them all wait for the read timeout
    and refuse none, and this takes a quarter of the time."""
    share = 256
    total = 2_500
    limits = {"request_read_timeout_s": 2, "max_inflight_requests": 4 * share}
    gw = await model_m_gateway(sim, gateway, tmp_path, limits)
    run_alone()
    clients = [RawClient("127.0.0.1", gw.port, source="127.0.0.2") for _ in range(total // 250)]
    try:
        for client in clients:
            await client.connect()
            for _ in range(250):
                client.open(GENERATE, [(b"x-model-id", b"m")], end=False)
        streams = [s for c in clients for s in c.streams.values()]

        async def flood_sorted() -> bool:  # all but the peer's share answered at once
            return sum(s.ended.is_set() for s in streams) >= total - share

        await until(flood_sorted, 20)
        await assert_served(gw)  # while the peer's share is held
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in streams)), 30)
        refused = [s for s in streams if s.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
        timed_out = [s for s in streams if s.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]]
        # The rest were CANCELLED by grpc core itself, which sheds calls the application
        # has not taken yet when thousands arrive at once (its pending-request bound).
        cancelled = grpc.StatusCode.CANCELLED.value[0]
        shed = [s for s in streams if s.status in (None, cancelled) and s.reset]
        print(f"\nrefused {len(refused)}, timed out {len(timed_out)}, shed {len(shed)}")
        # At most the peer's share at a time was let in (a slot freed by the read timeout
        # goes to a stream still arriving on this busy 2-core machine).
        assert len(timed_out) >= share
        assert len(refused) + len(timed_out) + len(shed) == total
        assert len(refused) > total // 4
        timeout_message = "No complete request message within 2 s"
        assert all(s.message.startswith(timeout_message) for s in timed_out)
        info, _ = details_of(refused[0].headers)
        assert info.reason == "CALLER_OVER_SHARE"
        assert refused[0].message == (
            f"This caller (peer:127.0.0.2) already has {share} requests in flight, its share "
            "of this gateway (limits.max_inflight_per_principal)"
        )
    finally:
        for client in clients:
            await client.close()


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


async def test_sighup_without_tls_reloads_and_ends_nothing(
    sim: Launcher, gateway: Launcher
) -> None:
    worker = sim("--model", "m", "--token-ms", "100")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        calls = [
            stub.Generate(sgl_generate(f"s{i}", tokens=20), metadata=model_md("m"))
            for i in range(4)
        ]
        for call in calls:
            await call.initial_metadata()  # relaying: the SIGHUPs come while they run
        streams = [asyncio.ensure_future(collect(call)) for call in calls]
        for _ in range(10):
            os.kill(gw.process.pid, signal.SIGHUP)
            await asyncio.sleep(0.05)
        for messages, error in await asyncio.gather(*streams):
            assert error is None and len(messages) == 21
    assert gw.process.poll() is None


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
