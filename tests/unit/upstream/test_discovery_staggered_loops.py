"""Hosts that join together (a discovery report names hundreds at once) are not joined,
probed and polled together: each waits a part of a window that grows with their number
before it joins (or leaves), and each worker's probe loop and load loop keeps a phase of
its own, spread over the interval, instead of all firing on the same tick forever."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.config import ProbeConfig, WorkerSpec, build_config
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.placement.policies import build_policy
from gateway.upstream import loops as loops_module
from gateway.upstream.health import active as prober_module
from gateway.upstream.health.active import ProbeLoop
from gateway.upstream.loops import load_loop
from gateway.upstream.manager import Fleet
from gateway.upstream.signals.probe import ProbeKind, ProbeResult
from gateway.upstream.stagger import HOST_COST_S, MAX_SPREAD_S, spread, waits
from tests.support.factories import make_worker
from tests.support.waits import until

HOSTS = 64
INTERVAL_S = 0.4
SGLANG = engine_adapters()[Runtime.SGLANG]


def quarters(offsets: list[float]) -> int:
    """In how many of the interval's four quarters the offsets fall (lockstep: one)."""
    return len({min(3, int(4 * (offset % INTERVAL_S) / INTERVAL_S)) for offset in offsets})


def test_the_first_wait_is_a_part_of_the_interval_then_the_interval() -> None:
    draws = iter([0.25])
    pauses = waits(2.0, lambda: next(draws))
    assert [next(pauses) for _ in range(3)] == [0.5, 2.0, 2.0]


async def test_probes_of_workers_that_joined_together_spread_over_the_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def probe_once(*args: Any) -> ProbeResult:
        return ProbeResult(ProbeKind.SERVING, "ok")

    monkeypatch.setattr(prober_module, "probe_once", probe_once)
    settings = ProbeConfig(interval_s=INTERVAL_S)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def second_probe(port: int) -> float:
        worker = make_worker(WorkerSpec("10.0.0.1", port, "m", Runtime.SGLANG))
        prober = ProbeLoop(worker, None, SGLANG, settings)
        await prober.probe()  # a new worker: probed at once
        await prober.next_result()
        return loop.time() - start

    offsets = await asyncio.gather(*(second_probe(port) for port in range(1, HOSTS + 1)))
    assert quarters(offsets) >= 3


async def test_load_polls_of_workers_that_joined_together_spread_over_the_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    polls: dict[str, list[float]] = {}

    async def poll_load(worker: Any, *args: Any) -> None:
        polls.setdefault(worker.id, []).append(loop.time())

    monkeypatch.setattr(loops_module, "poll_load", poll_load)
    fleet = Fleet(
        build_config(overrides={"loads.interval_s": INTERVAL_S}), engine_adapters(), build_policy
    )
    workers = [make_worker(WorkerSpec("10.0.0.1", p, "m")) for p in range(1, HOSTS + 1)]
    for worker in workers:
        worker.vocab_size = 0  # asked as it joined (no channel here)
    loads, watch = fleet.settings.loads, fleet.lora_watch
    tasks = [
        asyncio.ensure_future(load_loop(w, None, SGLANG, loads, watch, fleet.released))
        for w in workers
    ]
    try:
        await until(lambda: len(polls) == HOSTS and all(len(t) >= 2 for t in polls.values()))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert quarters([times[1] - times[0] for times in polls.values()]) >= 3


def test_hosts_joining_or_leaving_together_spread_over_up_to_a_second() -> None:
    assert spread(1, lambda: 1.0) == HOST_COST_S  # one host: next to nothing
    assert spread(100, lambda: 0.5) == pytest.approx(50 * HOST_COST_S)
    assert spread(10_000, lambda: 1.0) == MAX_SPREAD_S
    assert spread(255, lambda: 0.0) == 0.0
