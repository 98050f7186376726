"""What the flow control end-to-end tests share (tests/e2e/test_flow_e2e*.py): a gateway
process with a `flow:` config in front of simulated workers, a call that holds its
worker's slot, the queues' depth (ListQueues), and the request log's events with the check
that a call ended while queued was never placed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.client import admin_address, model_md, sgl_generate, write_config
from gateway_sim.launch import Child, worker_url
from tests.support.helpers import wait_for_events
from tests.support.launch import Launcher
from tests.support.waits import until

HOLD = ("x-sim-ttft-ms", "30000")  # a call that holds its worker's slot until cancelled


def flow_gateway(
    gateway: Launcher, tmp_path: Path, workers: Sequence[Any], settings: dict[str, Any], *flags: str
) -> Child:
    """`gateway serve` with `settings` as its config file, in front of `workers` (model m)."""
    urls = [
        arg for w in workers for arg in ("--worker", worker_url(w, model="m", runtime="sglang"))
    ]
    return gateway("--config", write_config(tmp_path, settings), *urls, *flags)


async def waiting(gw: Child) -> int:
    """Calls waiting in the gateway's queues (admin ListQueues), over every model."""
    async with aio.insecure_channel(admin_address(gw)) as ch:
        listed = await admin_pb2_grpc.AdminServiceStub(ch).ListQueues(
            admin_pb.ListQueuesRequest(), timeout=2
        )
    assert listed.enabled
    return sum(q.waiting for q in listed.queues)


async def until_waiting(gw: Child, count: int) -> None:
    async def check() -> bool:
        return await waiting(gw) == count

    await until(check, what=f"{count} calls waiting")


def one_event(gw: Child, request_id: str) -> dict[str, Any]:
    """The request log's event of one call (the log line follows the reply: bounded wait)."""
    (event,) = wait_for_events(gw.log_path, 1, request_id=request_id)
    return dict(event)


def assert_never_placed(event: dict[str, Any], code: str) -> None:
    """A call that ended while queued: no attempt, no worker, no leg."""
    assert event["code"] == code, event
    assert (event["attempts"], event["worker"], event["legs"]) == (0, None, None), event


async def hold(stub: Any, request_id: str = "held") -> Any:
    """A call holding its worker's slot; returns once the worker runs it (its headers)."""
    call = stub.Generate(sgl_generate(request_id), metadata=model_md("m", HOLD), timeout=60)
    await call.initial_metadata()
    return call
