"""SIGTERM to the gateway: every health entry NOT_SERVING at
once, keep serving for the drain delay, then refuse new calls while in-flight streams
finish within the grace, and exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import grpc

from gateway_sim.client import (
    NOT_SERVING,
    SERVING,
    channel,
    collect,
    health_check,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    wait_health,
    wait_health_status,
    wait_idle,
)
from gateway_sim.launch import Child, start_many, worker_url
from tests.support.availability import health_list, health_watch
from tests.support.launch import Launcher
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S

DRAIN_DELAY_S = 1.5
# Far past every wait below: a gateway that exits within them did not wait out its grace.
GRACE_S = 120.0


def urls(*children: Child) -> list[str]:
    args: list[str] = []
    for child in children:
        args += ["--worker", worker_url(child, model="m", runtime="sglang")]
    return args


async def wait_exit(child: Child, within_s: float) -> tuple[int, float]:
    """The exit code and the monotonic time it was seen (bounded; SIGKILL if late)."""
    try:
        code = await asyncio.to_thread(child.process.wait, within_s)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait()
        raise AssertionError(f"the gateway did not exit within {within_s}s") from None
    return code, time.monotonic()


async def long_stream(stub: Any, request_id: str, tokens: int, token_ms: int) -> Any:
    call = stub.Generate(
        sgl_generate(request_id, tokens=tokens),
        metadata=model_md("m", ("x-sim-token-ms", str(token_ms))),
        timeout=WAIT_S,
    )
    return call


@dataclass(frozen=True)
class Probe:
    """One new call sent during the drain: when it began and ended (seconds after the
    SIGTERM was sent) and how it ended."""

    began: float
    ended: float
    code: grpc.StatusCode
    details: str


async def probe_until_refused(address: str, terminated: float) -> list[Probe]:
    """New calls one after another, from now until 0.5 s after the first is refused
    (bounded: WAIT_S past the drain delay)."""
    probes: list[Probe] = []
    async with channel(address) as probe_ch:
        stub = sgl_grpc.SglangSchedulerStub(probe_ch)
        refused_at: float | None = None
        while refused_at is None or time.monotonic() - refused_at < 0.5:
            assert time.monotonic() - terminated < DRAIN_DELAY_S + WAIT_S, "never refused"
            began = time.monotonic()
            _, error = await collect(
                stub.Generate(sgl_generate(tokens=1), metadata=model_md("m"), timeout=WAIT_S)
            )
            code = error.code() if error else grpc.StatusCode.OK
            ended = time.monotonic()
            details = error.details() if error else ""
            probes.append(Probe(began - terminated, ended - terminated, code, details))
            if code is not grpc.StatusCode.OK and refused_at is None:
                refused_at = ended
            await asyncio.sleep(0.05)
    return probes


async def test_sigterm_drains_under_load_and_exits_0(
    sim: Launcher, gateway: Launcher, strict: bool
) -> None:
    """Issue figure 6. In order: NOT_SERVING announced while new calls are still served;
    every call that ended within the drain delay served; then every new call refused
    while the in-flight streams still run; they finish; the exit follows them, not the
    grace. The timing tier holds the figure's windows too: NOT_SERVING within 0.3 s,
    refusals from the delay's end within -0.2/+0.3 s, the exit within 1.5 s of the
    streams."""
    a, b = start_many(sim, ("--model", "m", "--name", "a"), ("--model", "m", "--name", "b"))
    gw = gateway("--drain-delay", str(DRAIN_DELAY_S), "--shutdown-grace", str(GRACE_S), *urls(a, b))
    await wait_health(gw.address, "m")
    run_alone()
    tokens, token_ms = 40, 100  # 4 s streams: they outlive the drain delay

    async with channel(gw.address) as watch_ch, channel(gw.address) as ch:
        watch = health_watch(watch_ch, "")
        await watch.wait_for(lambda s: s == SERVING, WAIT_S)
        stub = sgl_grpc.SglangSchedulerStub(ch)
        streams = [await long_stream(stub, f"long{i}", tokens, token_ms) for i in range(4)]
        for call in streams:
            await call.initial_metadata()  # every stream is relaying
        readers = [asyncio.create_task(collect(call)) for call in streams]
        await asyncio.sleep(0.2)

        terminated = time.monotonic()
        gw.process.send_signal(signal.SIGTERM)
        seen, _ = await watch.wait_for(lambda s: s == NOT_SERVING, WAIT_S)
        await watch.close()  # a load balancer that saw it goes away
        checked = await health_check(gw.address, "liveness")
        during = await health_list(gw.address)

        # New calls keep being served through the drain delay, then are refused.
        probes = await probe_until_refused(gw.address, terminated)
        refused_while_streaming = not any(reader.done() for reader in readers)
        async with channel(gw.address) as fresh:
            with_new_connection = await collect(
                sgl_grpc.SglangSchedulerStub(fresh).Generate(
                    sgl_generate(tokens=1), metadata=model_md("m"), timeout=WAIT_S
                )
            )

        results = await asyncio.wait_for(asyncio.gather(*readers), timeout=WAIT_S)
        streams_done = time.monotonic()
    code, exited = await wait_exit(gw, WAIT_S)

    served = [p for p in probes if p.code is grpc.StatusCode.OK]
    refused = [p for p in probes if p.code is not grpc.StatusCode.OK]
    last_ok, first_refused = served[-1].began, refused[0].began
    print(
        f"\n[figure 6] health NOT_SERVING seen by a Watch {(seen - terminated) * 1000:.0f} ms "
        f"after SIGTERM; new calls served until +{last_ok:.3f}s, refused from "
        f"+{first_refused:.3f}s (drain delay {DRAIN_DELAY_S}s); in-flight streams done at "
        f"+{streams_done - terminated:.3f}s; exit {code} at +{exited - terminated:.3f}s"
    )
    assert checked == NOT_SERVING
    assert set(during.values()) == {"NOT_SERVING"}
    assert {"", "liveness", "readiness", "models/m"} <= during.keys()
    # Served during the delay (after NOT_SERVING was seen), refused after it, never
    # anything else: every call that ended within the delay was served, and once one
    # was refused, every later one was.
    assert served and probes[: len(served)] == served
    assert all(p.code is grpc.StatusCode.OK for p in probes if p.ended < DRAIN_DELAY_S)
    for index, probe in enumerate(refused):
        if probe.code is grpc.StatusCode.CANCELLED:
            # grpc core's own race: a call that reaches the server in the instant its stop
            # begins is cancelled, not refused. Only at that instant: the first refused.
            assert index == 0 and probe.details == "CANCELLED", probe
            continue
        assert probe.code is grpc.StatusCode.UNAVAILABLE, probe
    assert refused_while_streaming  # the delay ended; the streams had the grace
    _, refused_new = with_new_connection
    assert refused_new is not None and refused_new.code() is grpc.StatusCode.UNAVAILABLE
    # Every in-flight stream completed normally.
    for messages, error in results:
        assert error is None, (error.code(), error.details())
        assert len(messages) == tokens + 1
        assert messages[-1].complete.finish_reason == "length"
    assert code == 0  # and within WAIT_S of the streams: long before the grace ends
    if strict:
        assert seen - terminated <= 0.3
        for probe in probes:
            if probe.code is grpc.StatusCode.CANCELLED:
                assert abs(probe.began - first_refused) < 0.01, probe
            if probe.began < DRAIN_DELAY_S - 0.2:
                assert probe.code is grpc.StatusCode.OK, probe
            if probe.began > DRAIN_DELAY_S + 0.3:
                assert probe.code is grpc.StatusCode.UNAVAILABLE, probe
        assert DRAIN_DELAY_S - 0.2 <= first_refused <= DRAIN_DELAY_S + 0.3
        assert exited - streams_done < 1.5


async def test_a_health_watcher_does_not_hold_up_the_exit(
    sim: Launcher, gateway: Launcher, strict: bool
) -> None:
    """gRPC clients with client-side health checking keep a Watch open on every
    connection. Once the drain has said NOT_SERVING, such a stream must not keep the
    gateway alive until the grace runs out: the exit follows the last real stream
    (within WAIT_S, long before the grace of GRACE_S; within 1.5 s in the timing tier)."""
    worker = sim("--model", "m", "--name", "a")
    gw = gateway("--drain-delay", "0.3", "--shutdown-grace", str(GRACE_S), *urls(worker))
    await wait_health(gw.address, "m")
    run_alone()
    async with channel(gw.address) as ch:
        watch = health_watch(ch, "")
        await watch.wait_for(lambda s: s == SERVING, WAIT_S)
        call = await long_stream(sgl_grpc.SglangSchedulerStub(ch), "one", 6, 100)
        await call.initial_metadata()
        reader = asyncio.create_task(collect(call))
        terminated = time.monotonic()
        gw.process.send_signal(signal.SIGTERM)
        await watch.wait_for(lambda s: s == NOT_SERVING, WAIT_S)
        messages, error = await asyncio.wait_for(reader, timeout=WAIT_S)
        stream_done = time.monotonic()
        code, exited = await wait_exit(gw, WAIT_S)
        await watch.close()
    print(
        f"\n[drain] with a health Watch open: stream done at +{stream_done - terminated:.3f}s, "
        f"exit {code} at +{exited - terminated:.3f}s (grace {GRACE_S}s); watch ended with "
        f"{watch.error.code() if watch.error else 'no error'}"
    )
    assert error is None and len(messages) == 7
    assert code == 0
    if strict:
        assert exited - stream_done < 1.5


async def test_stream_longer_than_the_grace_is_cut_and_its_worker_call_cancelled(
    sim: Launcher, gateway: Launcher, strict: bool
) -> None:
    """Past the grace the gateway stops anyway: the client's stream (5 s of tokens) ends
    UNAVAILABLE, never before the grace (within 1 s after it in the timing tier), the
    worker stops generating (its call is cancelled), and the exit is still 0."""
    worker = sim("--model", "m", "--name", "a")
    grace = 0.5
    gw = gateway("--drain-delay", "0", "--shutdown-grace", str(grace), *urls(worker))
    await wait_health(gw.address, "m")
    run_alone()
    async with channel(gw.address) as ch:
        call = await long_stream(sgl_grpc.SglangSchedulerStub(ch), "endless", 100, 50)
        await call.initial_metadata()
        terminated = time.monotonic()
        gw.process.send_signal(signal.SIGTERM)
        messages, error = await asyncio.wait_for(collect(call), WAIT_S)
        cut = time.monotonic() - terminated
    code, _ = await wait_exit(gw, WAIT_S)
    print(
        f"\n[drain] stream cut {cut:.3f}s after SIGTERM (grace {grace}s) with "
        f"{error.code() if error else None} after {len(messages)} messages; exit {code}"
    )
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
    assert 0 < len(messages) < 101
    assert grace - 0.1 <= cut
    if strict:
        assert cut <= grace + 1.0
    assert code == 0
    assert await wait_idle(worker.address) == 0


async def test_engine_health_check_turns_unhealthy_with_the_drain(
    sim: Launcher, gateway: Launcher
) -> None:
    """Balancers and routers that probe the engine's own HealthCheck RPC (SGLang-style
    routers do; so does this gateway's prober where grpc.health is missing) must see the
    drain as well: "everything NOT_SERVING at once", while calls are still served (the
    call after it proves it came within the delay)."""
    worker = sim("--model", "m", "--name", "a")
    gw = gateway("--drain-delay", "3.0", "--shutdown-grace", "1", *urls(worker))
    await wait_health(gw.address, "m")
    run_alone()
    gw.process.send_signal(signal.SIGTERM)
    await wait_health_status(gw.address, "models/m", NOT_SERVING)
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        reply = await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=model_md("m"))
        messages, error = await collect(stub.Generate(sgl_generate(), metadata=model_md("m")))
    assert error is None and len(messages) == 5  # still serving: the delay is not over
    code, _ = await wait_exit(gw, WAIT_S)
    print(f"\n[drain] engine HealthCheck during the drain delay: healthy={reply.healthy}")
    assert code == 0
    assert reply.healthy is False
