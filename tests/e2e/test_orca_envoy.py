"""Envoy's `client_side_weighted_round_robin` in front of two gateway replicas (real
processes), one of them busy (its worker five times slower to answer, so the same calls
per second keep more of them in flight): with the gateway's ORCA trailers on, Envoy
sends the busy replica a clearly smaller share of the calls than with them off (no
reports: plain round robin, half each).

Envoy weighs a replica by qps / utilization, the utilization being the report's
application_utilization (mean calls in flight / capacity): by Little's law that is
capacity / latency, so the shares go towards the inverse of the replicas' latencies."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gateway_sim.client import channel, model_md, sgl_generate, sgl_grpc, write_config
from gateway_sim.envoy import envoy_binary, host_weights, start_envoy
from gateway_sim.launch import Child, start_many, stop_child, worker_url
from tests.support.launch import Launcher

CONCURRENCY = 6  # calls Envoy's client keeps going at once
IDLE_TTFT_MS, BUSY_TTFT_MS = "25", "125"
WARMUP_S = 0.5  # connections up, the first calls through
SETTLE_S = 30.0  # at most, for Envoy's weights to show the reports (0.2 s blackout)
MEASURE_S = 3.0

Settled = Callable[[], Awaitable[bool]]


async def drive(port: int, settled: Settled) -> tuple[Counter[str], int]:
    """Closed-loop calls through Envoy; once the warm-up is over and `settled` (polled,
    bounded), the calls that start in the next MEASURE_S are counted by the worker (hence
    the replica) that answered them. Also: the calls that failed."""
    served: Counter[str] = Counter()
    failed = 0
    loop = asyncio.get_running_loop()
    counted_from = end = math.inf

    async def measure() -> None:
        nonlocal counted_from, end
        await asyncio.sleep(WARMUP_S)
        for _ in range(round(SETTLE_S / 0.1)):
            if await settled():
                break
            await asyncio.sleep(0.1)
        counted_from = loop.time()
        end = counted_from + MEASURE_S

    async def caller(stub: object, index: int) -> None:
        nonlocal failed
        sequence = 0
        while (began := loop.time()) < end:
            sequence += 1
            call = stub.Generate(  # type: ignore[attr-defined]
                sgl_generate(f"c{index}-{sequence}"), metadata=model_md("m"), timeout=10
            )
            try:
                headers = dict(await call.initial_metadata())
                async for _ in call:
                    pass
            except Exception:
                failed += 1
                continue
            if began >= counted_from:
                served[str(headers.get("x-sim-worker"))] += 1

    async with channel(f"127.0.0.1:{port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        async with asyncio.timeout(WARMUP_S + SETTLE_S + MEASURE_S + 15):
            await asyncio.gather(measure(), *(caller(stub, i) for i in range(CONCURRENCY)))
    return served, failed


def stop(processes: list[Child], *children: Child) -> None:
    for child in children:
        stop_child(child)
        processes.remove(child)


def configured(directory: Path, orca: bool) -> str:
    directory.mkdir()
    return write_config(directory, {"orca": {"trailers": orca}})


async def phase(
    orca: bool, workers: list[Child], gateway: Launcher, processes: list[Child], directory: Path
) -> tuple[Counter[str], int, str]:
    """Two replicas (one per worker) with ORCA trailers on or off, Envoy in front: the
    calls each worker served, the calls that failed, and Envoy's weights as measured."""
    binary = envoy_binary()
    assert binary is not None, "the envoy binary is missing: install the dev extra"
    config = configured(directory, orca)
    replicas = start_many(
        gateway,
        *(
            ("--config", config, "--worker", worker_url(w, model="m", runtime="sglang"))
            for w in workers
        ),
    )
    envoy = start_envoy(binary, [r.port for r in replicas], directory)
    processes.append(envoy)
    idle_port, busy_port = (r.port for r in replicas)
    weights: dict[int, int] = {}

    async def settled() -> bool:
        """ORCA off: at once (no reports, nothing to wait for); on: once Envoy weighs
        the busy replica below the idle one."""
        if not orca:
            return True
        weights.update(await asyncio.to_thread(host_weights, envoy.extra["admin"]))
        return weights.get(busy_port, 0) < weights.get(idle_port, 0)

    try:
        served, failed = await drive(envoy.port, settled)
    finally:
        stop(processes, envoy, *replicas)
    shown = f"busy {weights.get(busy_port)}, idle {weights.get(idle_port)}" if orca else "none"
    return served, failed, shown


@pytest.mark.serial
async def test_envoy_sends_the_busy_replica_fewer_calls_with_orca(
    sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    workers = [
        sim("--model", "m", "--name", "idle", "--ttft-ms", IDLE_TTFT_MS),
        sim("--model", "m", "--name", "busy", "--ttft-ms", BUSY_TTFT_MS),
    ]
    shares: dict[bool, float] = {}
    for orca in (False, True):
        directory = tmp_path / f"orca-{'on' if orca else 'off'}"
        served, failed, weights = await phase(orca, workers, gateway, processes, directory)
        total = served["idle"] + served["busy"]
        assert failed == 0 and total == sum(served.values()) and total > 50, (served, failed)
        shares[orca] = served["busy"] / total
        print(
            f"ORCA {'on ' if orca else 'off'}: busy replica {served['busy']} calls, "
            f"idle {served['idle']}: busy share {shares[orca]:.0%} (Envoy's weights: {weights})"
        )
    assert 0.4 <= shares[False] <= 0.6  # no reports: round robin
    assert shares[True] <= shares[False] - 0.15  # the busy replica's reports weigh it down
    assert shares[True] < 0.35
