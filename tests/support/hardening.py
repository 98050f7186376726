"""What the hardening end-to-end tests share (tests/e2e/test_hardening*.py): a gateway
process with given limits in front of one simulated worker of model m, and a normal call
to it that must still be served."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from gateway_sim.client import (
    channel,
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health,
    write_config,
)
from gateway_sim.launch import Child, worker_url
from tests.support.launch import Launcher


async def model_m_gateway(
    sim: Launcher, gateway: Launcher, tmp_path: Path, limits: Mapping[str, object] | None = None
) -> Child:
    """A gateway (with these `limits`) in front of one simulated worker of model m, ready."""
    worker = sim("--model", "m")
    args = ["--worker", worker_url(worker, model="m", runtime="sglang")]
    if limits:
        args += ["--config", write_config(tmp_path, {"limits": limits})]
    gw = gateway(*args)
    await wait_health(gw.address, "m")
    return gw


async def assert_served(gw: Child) -> None:
    """A normal call to model m, on its own channel, streams its five messages."""
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_generate("good"), metadata=model_md("m"), timeout=5)
        messages, error = await collect(call)
    assert error is None and len(messages) == 5
