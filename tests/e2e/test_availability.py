"""Worker availability end to end: a killed worker, a worker that says
NOT_SERVING (and one probed through the engine's HealthCheck), a frozen worker, a model
whose workers are all down. (The rolling restart under load, figure 4, is in process:
tests/component/test_availability.py.)

Each test measures the figure it checks and prints it (`pytest -s` shows them).
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import (
    NOT_SERVING,
    SERVING,
    SGL_SERVICE,
    VLLM_SERVICE,
    admin_address,
    channel,
    collect,
    generate_for,
    health_check,
    is_healthy,
    list_workers,
    model_md,
    sgl_generate,
    sgl_grpc,
    stub_for,
    wait_health_status,
    write_config,
)
from gateway_sim.launch import Child, start_many, worker_url
from tests.support.availability import (
    ClosedLoop,
    admin_watch,
    health_list,
    is_ready,
    status_event,
    wait_worker,
    wall_start,
)
from tests.support.helpers import assert_verdict, wait_for_events
from tests.support.launch import Launcher
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S

UNAVAILABLE_MESSAGE = (
    "All {n} regular workers for model '{model}' are unavailable "
    "(not connected, unhealthy or ejected by outlier detection)"
)

# Workers are signalled, frozen, killed and restarted on their port.
pytestmark = pytest.mark.sim_processes


def urls(*children: Child, model: str = "m", runtime: str = "sglang") -> list[str]:
    args: list[str] = []
    for child in children:
        args += ["--worker", worker_url(child, model=model, runtime=runtime)]
    return args


async def served_by(
    address: str, count: int, model: str = "m", runtime: str = "sglang"
) -> list[str]:
    """`count` sequential Generate calls; the worker name that served each (all must be OK)."""
    names = []
    async with channel(address) as ch:
        stub = stub_for(ch, runtime)
        for i in range(count):
            call = stub.Generate(
                generate_for(runtime, f"s{i}", tokens=1), metadata=model_md(model), timeout=5
            )
            messages, error = await collect(call)
            assert error is None, (error.code(), error.details())
            assert len(messages) == 2
            names.append(str(dict(await call.initial_metadata())["x-sim-worker"]))
    return names


# --------------------------------------------------------------------------- figure 1


HELD_TTFT_MS = "6000"  # the held requests' first message: long after the kill


async def test_sigkilled_worker_gets_no_new_request_after_one_second(
    sim: Launcher, gateway: Launcher
) -> None:
    """Issue figure 1. The default probe interval (1 s, two failures to condemn) could not
    meet the figure by itself: the connection drop has to."""
    a, victim = start_many(
        sim, ("--model", "m", "--name", "a"), ("--model", "m", "--name", "victim")
    )
    gw = gateway(*urls(a, victim))
    admin = admin_address(gw)
    for worker in (a, victim):
        await wait_worker(admin, worker.address, is_ready)
    run_alone()
    async with aio.insecure_channel(admin) as admin_ch, channel(gw.address) as held_ch:
        watch = admin_watch(admin_ch)
        # Requests the victim has accepted (its headers are relayed) but not yet answered
        # with a first message when it dies: round robin puts two of four on it. Their
        # first message is far enough off that the kill comes first on a loaded machine.
        held = [
            sgl_grpc.SglangSchedulerStub(held_ch).Generate(
                sgl_generate(f"held{i}", tokens=2),
                metadata=model_md(
                    "m", ("x-sim-ttft-ms", HELD_TTFT_MS), ("x-sim-headers-first", "1")
                ),
                timeout=WAIT_S,
            )
            for i in range(4)
        ]
        first_worker = [str(dict(await c.initial_metadata())["x-sim-worker"]) for c in held]
        assert sorted(first_worker) == ["a", "a", "victim", "victim"]
        held_results = [asyncio.create_task(collect(c)) for c in held]
        async with ClosedLoop(gw.address, loops=5, tokens=8, token_ms=15, prefix="k") as load:
            await load.wait_calls(30)
            before = load.served_by()
            # Kill while streams are relaying from the victim.
            kill_wall, kill_at = time.time(), time.monotonic()
            victim.kill()
            await asyncio.sleep(1.6)
        down_at, event = await watch.wait_for(
            status_event(victim.address, admin_pb.WORKER_STATUS_NOT_READY), 1.0
        )
        await watch.close()
        held_done = await asyncio.wait_for(asyncio.gather(*held_results), WAIT_S)

    results = load.results
    failures = load.failures()
    print(
        f"\n[figure 1] calls={len(results)} failed={len(failures)} "
        f"victim unroutable after {down_at - kill_at:.3f}s (cause {event.cause!r})"
    )
    assert before.keys() == {"a", "victim"}, before
    assert down_at - kill_at <= 1.0
    # Only streams that were already relaying from the victim may fail, with UNAVAILABLE,
    # promptly (never a hang until the deadline).
    for failed in failures:
        assert failed.code is grpc.StatusCode.UNAVAILABLE, failed
        assert failed.worker == "victim", failed
        assert failed.messages >= 1, failed
        assert failed.started < kill_at, failed
        assert failed.ended - kill_at < 1.0, failed
    assert len(failures) <= load.loops
    after = load.served_by(since=kill_at + 1.0)
    assert after.keys() == {"a"} and after["a"] >= 5, after

    # The gateway's own record: once a second has passed, no placement touches the victim
    # (a request placed on it would show as its worker, or as a second attempt).
    events = [
        e
        for e in wait_for_events(gw.log_path, len(results), rpc="Generate")
        if str(e.get("request_id", "")).startswith("k-")
    ]
    assert len(events) == len(results)
    touched = [
        wall_start(e) - kill_wall
        for e in events
        if wall_start(e) >= kill_wall and (e["worker"] == victim.address or e["attempts"] > 1)
    ]
    failover = max(touched, default=0.0)
    print(
        f"[figure 1] placements touching the victim after the kill: {len(touched)}, "
        f"last at +{failover:.3f}s; retried before the first message: "
        f"{sum(1 for e in events if e['attempts'] > 1)}"
    )
    assert failover <= 1.0
    late = [e for e in events if wall_start(e) > kill_wall + 1.0]
    assert late
    assert all(e["worker"] == a.address and e["attempts"] == 1 for e in late)
    failed_ids = {f.request_id for f in failures}
    assert all(e["code"] == "OK" for e in events if e["request_id"] not in failed_ids)

    # The held requests on the victim had no first message: retried on `a`, served in full.
    for messages, error in held_done:
        assert error is None, (error.code(), error.details())
        assert len(messages) == 3
    held_events = {
        e["request_id"]: e
        for e in wait_for_events(gw.log_path, 1, rpc="Generate")
        if str(e.get("request_id", "")).startswith("held")
    }
    assert len(held_events) == 4
    for i, name in enumerate(first_worker):
        event = held_events[f"held{i}"]
        assert (event["code"], event["worker"]) == ("OK", a.address)
        assert event["attempts"] == (2 if name == "victim" else 1)


# --------------------------------------------------------------------------- figure 2


async def test_not_serving_worker_is_unroutable_within_one_probe_interval(
    sim: Launcher, gateway: Launcher
) -> None:
    """Issue figure 2 at the default success threshold (2) and half the default probe
    interval (0.5 s, not 1 s): the bounds are in probe intervals, so they tell a gateway
    that meets them from one that does not as well, in half the time the test runs
    alone."""
    interval, threshold = 0.5, 2
    a, b = start_many(sim, ("--model", "m", "--name", "a"), ("--model", "m", "--name", "b"))
    gw = gateway("--probe-interval", str(interval), *urls(a, b))
    admin = admin_address(gw)
    for worker in (a, b):
        await wait_worker(admin, worker.address, is_ready)
    run_alone()
    async with aio.insecure_channel(admin) as admin_ch:
        watch = admin_watch(admin_ch)
        await watch.wait_for(lambda e: e.kind == admin_pb.WORKER_EVENT_KIND_SNAPSHOT, 2.0)

        flipped = time.monotonic()
        a.process.send_signal(signal.SIGUSR1)
        down_at, down = await watch.wait_for(
            status_event(a.address, admin_pb.WORKER_STATUS_NOT_READY), 3 * interval
        )
        assert down.cause == "probe: grpc.health NOT_SERVING"
        assert await served_by(gw.address, 6) == ["b"] * 6
        assert (await list_workers(admin))[a.address].status == admin_pb.WORKER_STATUS_NOT_READY

        restored = time.monotonic()
        a.process.send_signal(signal.SIGUSR2)
        up_at, up = await watch.wait_for(
            status_event(a.address, admin_pb.WORKER_STATUS_READY), 3 * interval * threshold
        )
        assert up.cause == "probe: grpc.health SERVING"
        await watch.close()
    detection, recovery = down_at - flipped, up_at - restored
    print(
        f"\n[figure 2] NOT_SERVING -> unroutable in {detection:.3f}s (interval {interval}s); "
        f"SERVING -> routable in {recovery:.3f}s (interval x threshold = "
        f"{interval * threshold}s)"
    )
    assert detection <= 2 * interval
    # Recovery takes `threshold` good probes: never a single one, and no more than that.
    assert interval * (threshold - 1) - 0.05 <= recovery <= interval * threshold + 0.5
    assert sorted(set(await served_by(gw.address, 6))) == ["a", "b"]


async def test_worker_without_grpc_health_is_probed_with_the_engine_health_check(
    sim: Launcher, gateway: Launcher
) -> None:
    """Issue figure 2, the fallback: grpc.health UNIMPLEMENTED -> the engine's HealthCheck."""
    bare = dict(
        zip(
            ("sglang", "vllm"),
            start_many(
                sim,
                *[
                    (
                        "--runtime",
                        rt,
                        "--model",
                        f"{rt}-m",
                        "--name",
                        f"bare-{rt}",
                        "--no-grpc-health",
                    )
                    for rt in ("sglang", "vllm")
                ],
            ),
            strict=True,
        )
    )
    # The workers really have no grpc.health: the gateway must fall back.
    for worker in bare.values():
        async with channel(worker.address) as ch:
            with pytest.raises(aio.AioRpcError) as caught:
                await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=2)
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED

    gw = gateway(
        "--probe-interval",
        "0.2",
        *[arg for rt, w in bare.items() for arg in urls(w, model=f"{rt}-m", runtime=rt)],
    )
    admin = admin_address(gw)
    healthy = {"sglang": "Health check passed", "vllm": "Health"}  # each servicer's words
    for runtime, worker in bare.items():
        model = f"{runtime}-m"
        ready = await wait_worker(admin, worker.address, is_ready)
        assert ready.last_probe.kind == admin_pb.PROBE_KIND_SERVING
        assert ready.last_probe.detail == f"HealthCheck healthy=True {healthy[runtime]}"
        assert ready.status_cause == f"probe: HealthCheck healthy=True {healthy[runtime]}"
        assert await served_by(gw.address, 2, model, runtime) == [f"bare-{runtime}"] * 2

        # The engine's answer drives the status both ways.
        flipped = time.monotonic()
        worker.process.send_signal(signal.SIGUSR1)
        down = await wait_worker(
            admin, worker.address, lambda w: w.status == admin_pb.WORKER_STATUS_NOT_READY
        )
        went_down = time.monotonic() - flipped
        assert down.last_probe.kind == admin_pb.PROBE_KIND_NOT_SERVING
        assert down.last_probe.detail == "HealthCheck healthy=False not serving"
        assert await is_healthy(gw.address, model, runtime) is False
        flipped = time.monotonic()
        worker.process.send_signal(signal.SIGUSR2)
        await wait_worker(admin, worker.address, is_ready)
        print(
            f"\n[figure 2 fallback {runtime}] engine HealthCheck: unroutable after "
            f"{went_down:.3f}s, routable again after {time.monotonic() - flipped:.3f}s "
            "(interval 0.2s)"
        )
        assert await served_by(gw.address, 1, model, runtime) == [f"bare-{runtime}"]


async def test_wedged_worker_is_unroutable_after_its_probes_time_out(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """A frozen worker (SIGSTOP) keeps its TCP connection: only the probe timeouts can
    tell, after failure_threshold probes of interval + timeout each."""
    interval, timeout, failures, successes = 0.2, 0.3, 2, 2
    a, b = start_many(sim, ("--model", "m", "--name", "a"), ("--model", "m", "--name", "b"))
    config = write_config(
        tmp_path,
        {
            "probe": {
                "interval_s": interval,
                "timeout_s": timeout,
                "failure_threshold": failures,
                "success_threshold": successes,
            }
        },
    )
    gw = gateway("--config", config, *urls(a, b))
    admin = admin_address(gw)
    for worker in (a, b):
        await wait_worker(admin, worker.address, is_ready)
    run_alone()
    frozen = time.monotonic()
    a.process.send_signal(signal.SIGSTOP)
    try:
        down = await wait_worker(
            admin, a.address, lambda w: w.status == admin_pb.WORKER_STATUS_NOT_READY
        )
        detected = time.monotonic() - frozen
        assert down.connected  # the connection never dropped
        assert down.last_probe.kind == admin_pb.PROBE_KIND_ERROR
        assert down.last_probe.detail.startswith("DEADLINE_EXCEEDED")
        assert await served_by(gw.address, 4) == ["b"] * 4
    finally:
        thawed = time.monotonic()
        a.process.send_signal(signal.SIGCONT)
    await wait_worker(admin, a.address, is_ready)
    recovered = time.monotonic() - thawed
    print(
        f"\n[wedged] SIGSTOP -> unroutable after {detected:.3f}s (limit {failures} x "
        f"({interval}+{timeout})s); SIGCONT -> routable after {recovered:.3f}s"
    )
    assert detected <= failures * (interval + timeout) + 0.3
    assert recovered <= successes * interval + timeout + 0.3
    assert sorted(set(await served_by(gw.address, 4))) == ["a", "b"]


# --------------------------------------------------------------------------- figure 3


async def test_model_with_every_worker_down_is_unavailable_and_others_are_not(
    sim: Launcher, gateway: Launcher
) -> None:
    """Issue figure 3."""
    m1, m2, p, o = start_many(
        sim,
        ("--model", "m", "--name", "m1"),
        ("--model", "m", "--name", "m2"),
        ("--model", "p", "--name", "p"),
        ("--runtime", "vllm", "--model", "o", "--name", "o"),
    )
    gw = gateway(
        *urls(m1, m2),
        *urls(p, model="p"),
        *urls(o, model="o", runtime="vllm"),
    )
    for name in ("models/m", "models/p", "models/o"):
        await wait_health_status(gw.address, name, SERVING)

    killed = time.monotonic()
    m1.kill()
    m2.kill()
    seen = await wait_health_status(gw.address, "models/m", NOT_SERVING, within_s=2.0)
    print(f"\n[figure 3] models/m NOT_SERVING {seen - killed:.3f}s after its workers died")

    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_generate(), metadata=model_md("m"), timeout=5)
        assert len(await call.initial_metadata()) == 0  # Trailers-Only
        messages, error = await collect(call)
    assert messages == []
    assert error is not None
    assert_verdict(
        error,
        grpc.StatusCode.UNAVAILABLE,
        "WORKERS_UNAVAILABLE",
        UNAVAILABLE_MESSAGE.format(n=2, model="m"),
        {"model": "m", "leg": "regular", "httpStatus": "503", "code": "no_available_workers"},
        retry_s=1,
        pushback_ms=1000,
    )
    assert await is_healthy(gw.address, "m") is False

    # Every other entry is untouched: p still makes SglangScheduler servable.
    assert await health_list(gw.address) == {
        "": "SERVING",
        "liveness": "SERVING",
        "readiness": "SERVING",
        SGL_SERVICE: "SERVING",
        VLLM_SERVICE: "SERVING",
        "models/m": "NOT_SERVING",
        "models/p": "SERVING",
        "models/o": "SERVING",
    }
    for name in ("models/p", "models/o", SGL_SERVICE, VLLM_SERVICE, "readiness"):
        assert await health_check(gw.address, name) == SERVING
    assert await served_by(gw.address, 3, model="p") == ["p"] * 3
    assert await served_by(gw.address, 3, model="o", runtime="vllm") == ["o"] * 3
    assert await is_healthy(gw.address, "p") is True
    assert await is_healthy(gw.address, "o", "vllm") is True
