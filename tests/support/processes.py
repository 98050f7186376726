"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.client import MAX, POLL_S, model_md, sgl, sgl_grpc
from gateway_sim.launch import Child
from tests.support.helpers import request_events
from tests.support.waits import WAIT_S

PROCESSES = ("--processes", "2", "--probe-interval", "0.2")


async def wait_servable(ch: aio.Channel, model: str, within_s: float = WAIT_S) -> float:
    """Poll (bounded) this connection's process until it can serve `model`; returns when."""
    deadline = time.monotonic() + within_s
    while not await healthy(ch, model):
        assert time.monotonic() < deadline, f"{model!r} not servable within {within_s} s"
        await asyncio.sleep(POLL_S / 5)
    return time.monotonic()


async def per_process(gw: Child, model: str = "m", count: int = 2) -> dict[int, aio.Channel]:
    """One connection held on each serving process, found by the process the request log
    names for a HealthCheck sent on it (the log line is written before the reply)."""
    found: dict[int, aio.Channel] = {}
    for _ in range(CONNECTIONS):
        ch = own_channel(gw.address)
        await healthy(ch, model)
        process = int(request_events(gw.log_path, "HealthCheck")[-1]["process"])
        if process in found:
            await ch.close()
        else:
            found[process] = ch
        if len(found) == count:
            return found
    raise AssertionError(f"{CONNECTIONS} connections all landed on processes {sorted(found)}")


def admin_stub(gw: Child) -> tuple[aio.Channel, Any]:
    ch = aio.insecure_channel(f"127.0.0.1:{gw.port_of('admin')}")
    return ch, admin_pb2_grpc.AdminServiceStub(ch)


def scrape(gw: Child) -> dict[str, float]:
    """The /metrics samples as `name{labels}` -> value."""
    url = f"http://127.0.0.1:{gw.port_of('metrics')}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever adopted it to reap it has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def serving_processes(gw: Child) -> list[int]:
    """The pids of the supervisor's serving processes (its children)."""
    pid = gw.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sorted(int(c) for c in children)


CONNECTIONS = 64  # P(all on one of 2 processes) = 2**-63


def own_channel(address: str) -> aio.Channel:
    """A channel with its own connection (channels otherwise share one per target)."""
    return aio.insecure_channel(
        address,
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", MAX),
            ("grpc.enable_retries", 0),
        ],
    )


async def healthy(ch: aio.Channel, model: str) -> bool:
    """The engine HealthCheck of this connection's process (False: a model it does not know)."""
    try:
        reply = await sgl_grpc.SglangSchedulerStub(ch).HealthCheck(
            sgl.HealthCheckRequest(), metadata=model_md(model), timeout=2
        )
    except aio.AioRpcError as error:
        assert error.code() is grpc.StatusCode.NOT_FOUND, error
        return False
    return bool(reply.healthy)
