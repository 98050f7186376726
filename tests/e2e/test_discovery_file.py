"""File discovery with `gateway serve` as a real process: an edit of the watched file is
picked up within 2 s, a broken edit changes nothing, and a discovered worker cannot be
removed through the admin API (it would come back)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from tests.conftest import Launcher, worker_url
from tests.e2e.availability_helpers import admin_address, list_workers
from tests.e2e.helpers import wait_health, write_config


def log_events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


async def listed_within(admin: str, expected: list[str], limit_s: float) -> float:
    """Seconds until ListWorkers shows exactly `expected` (ids); fails past `limit_s`."""
    start = time.monotonic()
    while sorted(await list_workers(admin)) != sorted(expected):
        assert time.monotonic() - start <= limit_s, f"not {expected} within {limit_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_an_edit_is_picked_up_within_2s_and_a_broken_edit_keeps_the_hosts(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    a = sim("--model", "m", "--name", "a")
    b = sim("--model", "m", "--name", "b")
    listed = tmp_path / "workers.yaml"
    listed.write_text(yaml.safe_dump([worker_url(a, model="m", runtime="sglang")]))
    config = {"discovery": [{"source": "file", "path": str(listed), "interval_s": 0.5}]}
    gw = gateway("--config", write_config(tmp_path, config))
    await wait_health(gw.address, "m")
    admin = admin_address(gw)
    workers = await list_workers(admin)
    assert list(workers) == [a.address]
    assert list(workers[a.address].sources) == [f"file:{listed}"]

    urls = [worker_url(w, model="m", runtime="sglang") for w in (a, b)]
    listed.write_text(yaml.safe_dump({"workers": urls}))
    took = await listed_within(admin, [a.address, b.address], 2.0)

    listed.write_text("workers: [grpc://nowhere")  # an editor saving half a file
    await asyncio.sleep(1.5)  # three checks of the file: each keeps the hosts
    assert sorted(await list_workers(admin)) == sorted([a.address, b.address])
    lines = [e for e in log_events(gw.log_path) if e.get("event") == "discovery_failed"]
    assert len(lines) == 1 and lines[0]["source"] == f"file:{listed}"  # once per outage

    listed.write_text(yaml.safe_dump([urls[1]]))
    await listed_within(admin, [b.address], 2.0 + 1.0)  # + the drain of a (idle: at once)
    print(f"edit picked up after {took:.2f} s (limit 2 s)")


async def test_removing_a_discovered_worker_is_refused_and_draining_it_works(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    a = sim("--model", "m")
    listed = tmp_path / "workers.yaml"
    listed.write_text(yaml.safe_dump([worker_url(a, model="m", runtime="sglang")]))
    config = {"discovery": [{"source": "file", "path": str(listed)}]}
    gw = gateway("--config", write_config(tmp_path, config))
    await wait_health(gw.address, "m")
    async with aio.insecure_channel(admin_address(gw)) as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        try:
            await stub.RemoveWorker(admin_pb.RemoveWorkerRequest(worker_id=a.address), timeout=5)
            raise AssertionError("RemoveWorker of a discovered worker was accepted")
        except aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert exc.details() == (
                f"worker {a.address} is listed by file:{listed}: remove it there "
                "(RemoveWorker would see it come back); DrainWorker stops its new calls"
            )
        drained = await stub.DrainWorker(
            admin_pb.DrainWorkerRequest(worker_id=a.address), timeout=5
        )
        assert drained.worker.status == admin_pb.WORKER_STATUS_DRAINING
