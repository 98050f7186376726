"""Hosts a file source adds by the hundred and then drops leave nothing behind: their
tasks, timers, channels, KV followers and table entries go with them, and no thread or
memory per host stays (a second flood costs nothing more). The gateway runs in the test's
own event loop so its tables can be read; the hosts are closed ports."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.app.server import Gateway
from gateway.config import FileDiscovery
from gateway.upstream.load.kv_events import FollowState
from gateway_sim.client import closed_port, dead_worker_url
from tests.support.inproc import gateway, sim
from tests.support.waits import until

HOSTS = FileDiscovery(source="file", path="x").max_hosts - 1  # the one worker makes it full


def threads() -> int:
    """This process's threads, grpc core's included (threading sees only Python's)."""
    return len(os.listdir("/proc/self/task"))


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def following(gw: Gateway, address: str) -> bool:
    follower = gw.parts.fleet.followers.get(address)
    return follower is not None and follower.state is FollowState.FOLLOWING


def task_kinds() -> Counter[str]:
    """The loop's tasks by their coroutine's name (grpc's own, compiled by Cython, have
    one too): which kind a flood left behind, when one did."""
    return Counter(
        getattr(task.get_coro(), "__qualname__", type(task.get_coro()).__name__)
        for task in asyncio.all_tasks()
    )


def leftovers(gw: Gateway, kept: str) -> dict[str, object]:
    """What the fleet and membership still hold for any address but `kept`."""
    fleet, members = gw.parts.fleet, gw.parts.membership
    tables: dict[str, object] = {
        "registry": [w.id for w in fleet.registry if w.id != kept],
        "channels": [w.id for w in fleet._channels if w.id != kept],
        "tasks": [key for key in fleet._tasks if key != kept],
        "timers": [key for key in fleet._timers if key != kept],
        "followers": [key for key in fleet.followers if key != kept],
        "fleet joining": [u.spec.address for u in fleet.registry.unidentified()],
        "kv index": [key for key in fleet.kv_index._workers if key != kept],
        "membership joining": sorted(members._joining),
        "membership leaving": sorted(members._leaving),
        "membership expiry": sorted(members._expiry),
        "membership warned": sorted(members._warned),
        "claims": [a for hosts in members._claims.values() for a in hosts if a != kept],
    }
    return {name: left for name, left in tables.items() if left}


@dataclass(frozen=True)
class Cost:
    tasks: int
    python_threads: int
    threads: int
    rss_mib: float

    @staticmethod
    def now() -> Cost:
        return Cost(len(asyncio.all_tasks()), threading.active_count(), threads(), rss_mib())


async def test_hosts_that_leave_take_what_they_cost_with_them(tmp_path: Path) -> None:
    async with sim("--model", "m") as a:
        listed = tmp_path / "workers.yaml"
        one = [a.url(model="m", runtime="sglang")]
        listed.write_text(yaml.safe_dump(one))
        source = {"source": "file", "path": str(listed), "interval_s": 0.1}
        settings: dict[str, Any] = {"discovery": [source], "kv.events": True}
        async with gateway(**settings) as gw:
            await until(lambda: gw.parts.fleet.registry.get(a.address) is not None)
            # The baseline once the worker's KV stream is up: counted before it, the stream's
            # own task came after as one more than before (a CI run: 50 tasks, then 51).
            await until(lambda: following(gw, a.address))
            costs = [Cost.now()]
            kinds = task_kinds()

            async def flood_and_back() -> None:
                closed = [closed_port() for _ in range(HOSTS)]
                try:
                    # Half name their model (registered at once), half do not: they stay
                    # joining (asking a worker that never answers what it serves).
                    named = [dead_worker_url(s, model="m", runtime="sglang") for s in closed]
                    urls = named[: HOSTS // 2] + [dead_worker_url(s) for s in closed[HOSTS // 2 :]]
                    listed.write_text(yaml.safe_dump(one + urls))
                    await until(lambda: len(gw.parts.fleet.followers) == HOSTS // 2 + 1, 60)
                    await until(lambda: len(gw.parts.membership._joining) == HOSTS - HOSTS // 2, 60)
                    costs.append(Cost.now())
                    listed.write_text(yaml.safe_dump(one))
                    try:
                        await until(lambda: not leftovers(gw, a.address), 60)
                    except AssertionError:
                        raise AssertionError(f"left: {leftovers(gw, a.address)}") from None
                finally:
                    for sock in closed:
                        sock.close()
                try:
                    await until(lambda: len(asyncio.all_tasks()) <= costs[0].tasks)
                except AssertionError:
                    more = task_kinds() - kinds
                    raise AssertionError(f"{costs[0].tasks} tasks before; more: {more}") from None
                costs.append(Cost.now())

            await flood_and_back()
            await flood_and_back()
            assert gw.parts.fleet.registry.get(a.address) is not None
    print(
        f"{HOSTS} hosts, twice: tasks {' -> '.join(str(c.tasks) for c in costs)}; "
        f"threads {' -> '.join(str(c.threads) for c in costs)}; "
        f"RSS {' -> '.join(f'{c.rss_mib:.0f}' for c in costs)} MiB"
    )
    before, once, twice = costs[0], costs[2], costs[4]
    # No thread stays per host: grpc core's pool keeps the few threads a burst of work
    # made it start for as long as work comes at least every 20 s, and a second flood
    # adds none of Python's. No memory per host stays either: a second flood reuses what
    # the first one left to the allocator.
    assert twice.python_threads == once.python_threads
    assert twice.threads <= before.threads + 8
    assert twice.rss_mib <= once.rss_mib + 16
