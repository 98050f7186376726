"""`gateway workers resume` undoes a drain, through the supervisor of `--processes 2` as
through one process: the drained worker gets calls again; an unknown worker is exit
status 3 (NOT_FOUND)."""

from __future__ import annotations

import grpc
import pytest

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    list_workers,
    model_md,
    sgl_generate,
    sgl_grpc,
)
from gateway_sim.launch import worker_url
from tests.support.availability import is_ready, run_cli_async, wait_worker
from tests.support.launch import Launcher
from tests.support.waits import until


@pytest.mark.parametrize("count", ["1", "2"])
async def test_resume_puts_a_drained_worker_back(
    sim: Launcher, gateway: Launcher, count: str
) -> None:
    a, b = sim("--model", "m", "--name", "a"), sim("--model", "m", "--name", "b")
    urls = [worker_url(w, model="m", runtime="sglang") for w in (a, b)]
    gw = gateway(
        "--processes",
        count,
        "--probe-interval",
        "0.2",
        "--worker",
        urls[0],
        "--worker",
        urls[1],
    )
    admin = admin_address(gw)
    for worker in (a, b):
        await wait_worker(admin, worker.address, is_ready)

    async def served_by() -> str:
        async with channel(gw.address) as ch:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_generate("r", tokens=1), metadata=model_md("m"), timeout=10
            )
            _, error = await collect(call)
            assert error is None, error
            return str(dict(await call.initial_metadata())["x-sim-worker"])

    drained = await run_cli_async("workers", "drain", "--admin", admin, a.address)
    assert drained.returncode == 0, drained.stderr
    assert {await served_by() for _ in range(6)} == {"b"}
    resumed = await run_cli_async("workers", "resume", "--admin", admin, a.address)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith(f"resumed {a.address} ")
    state = (await list_workers(admin))[a.address]
    assert state.status == admin_pb.WORKER_STATUS_READY

    async def a_serves_again() -> bool:
        return await served_by() == "a"

    await until(a_serves_again, what="calls reach the resumed worker")
    unknown = await run_cli_async("workers", "resume", "--admin", admin, "127.0.0.1:1")
    assert unknown.returncode == 3, unknown.stderr  # NOT_FOUND
    assert grpc.StatusCode.NOT_FOUND.name in unknown.stderr
