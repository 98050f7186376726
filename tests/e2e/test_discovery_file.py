"""File discovery with `gateway serve` as a real process: an edit of the watched file is
picked up within 2 s, a broken edit changes nothing, and a discovered worker cannot be
removed through the admin API (it would come back)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.client import (
    admin_address,
    closed_port,
    dead_worker_url,
    list_workers,
    wait_health,
    write_config,
)
from gateway_sim.launch import worker_url
from tests.support.availability import labels, samples, scrape
from tests.support.launch import Launcher
from tests.support.waits import until


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


async def test_a_file_over_max_hosts_is_refused_and_the_hosts_stay(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    a = sim("--model", "m")
    listed = tmp_path / "workers.yaml"
    one = [worker_url(a, model="m", runtime="sglang")]
    listed.write_text(yaml.safe_dump(one))
    source = {"source": "file", "path": str(listed), "interval_s": 0.2, "max_hosts": 4}
    config = {"discovery": [source], "metrics": {"listen": "127.0.0.1:0"}}
    gw = gateway("--config", write_config(tmp_path, config))
    await wait_health(gw.address, "m")
    admin = admin_address(gw)
    closed = [closed_port() for _ in range(8)]
    try:
        many = one + [dead_worker_url(s, model="m", runtime="sglang") for s in closed]
        listed.write_text(yaml.safe_dump(many))
        await until(lambda: "discovery_too_many_hosts" in events_of(gw.log_path))
        lines = events_of(gw.log_path)["discovery_too_many_hosts"]
        assert lines[0]["hosts"] == 9 and lines[0]["max_hosts"] == 4
        assert lines[0]["source"] == f"file:{listed}" and lines[0]["hosts_kept"] == 1
        assert list(await list_workers(admin)) == [a.address]
        listed.write_text(yaml.safe_dump(many[:3]))  # under the bound: taken
        await listed_within(admin, [a.address, *many_addresses(closed[:2])], 5.0)
    finally:
        for sock in closed:
            sock.close()
    events = events_of(gw.log_path)
    assert len(events["discovery_too_many_hosts"]) == 1  # once per outage
    assert len(events["discovery_recovered"]) == 1
    text = await asyncio.to_thread(scrape, gw)
    errors = samples(text, "gateway_discovery_errors_total")
    assert errors[labels(source=f"file:{listed}")] >= 1


def events_of(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The log's lines by event."""
    found: dict[str, list[dict[str, Any]]] = {}
    for event in log_events(path):
        found.setdefault(str(event.get("event")), []).append(event)
    return found


def many_addresses(sockets: list[socket.socket]) -> list[str]:
    return [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
