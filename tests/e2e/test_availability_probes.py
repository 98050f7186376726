"""Worker availability end to end, by the gateway's health probes (figure 2): a worker that
says NOT_SERVING is unroutable within one probe interval, one without gRPC health is probed
with the engine's HealthCheck, a wedged one is unroutable once its probes time out.

Each test measures the figure it checks and prints it (`pytest -s` shows them).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import admin_address, channel, is_healthy, list_workers, write_config
from gateway_sim.launch import start_many
from tests.support.availability import (
    admin_watch,
    is_ready,
    served_by,
    status_event,
    urls,
    wait_worker,
)
from tests.support.launch import Launcher
from tests.support.serial import run_alone

# Workers are signalled, frozen, killed and restarted on their port.
pytestmark = pytest.mark.sim_processes


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
