"""Workers killed under the gateway process: while ready, and after their headers but
before a message. (The retry rules themselves are tested in process,
tests/component/test_retries.py.)
"""

from __future__ import annotations

import pytest

from gateway_sim.client import channel, collect, model_md, sgl_generate, sgl_grpc, wait_health
from gateway_sim.launch import Child, start_many, worker_url
from tests.support.helpers import wait_for_events
from tests.support.launch import Launcher


def urls(*children: Child) -> list[str]:
    args: list[str] = []
    for child in children:
        args += ["--worker", worker_url(child, model="m", runtime="sglang")]
    return args


@pytest.mark.sim_processes  # SIGKILL
async def test_worker_killed_while_ready_is_not_felt_by_clients(
    sim: Launcher, gateway: Launcher
) -> None:
    a, doomed = start_many(
        sim, ("--model", "m", "--name", "a"), ("--model", "m", "--name", "doomed")
    )
    gw = gateway(*urls(a, doomed))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        # Both workers serve (round robin) ...
        served = set()
        for i in range(2):
            call = stub.Generate(sgl_generate(f"w{i}", tokens=1), metadata=model_md("m"))
            _, error = await collect(call)
            assert error is None
            served.add(dict(await call.initial_metadata())["x-sim-worker"])
        assert served == {"a", "doomed"}
        # ... then one dies; whether or not the gateway has noticed yet, nobody fails.
        doomed.kill()
        for i in range(6):
            call = stub.Generate(sgl_generate(f"r{i}", tokens=2), metadata=model_md("m"))
            messages, error = await collect(call)
            assert error is None, error
            assert len(messages) == 3
            assert dict(await call.initial_metadata())["x-sim-worker"] == "a"


@pytest.mark.sim_processes  # SIGKILL
async def test_worker_dying_after_its_headers_but_before_a_message_is_retried(
    sim: Launcher, gateway: Launcher
) -> None:
    a, b = start_many(sim, ("--model", "m", "--name", "a"), ("--model", "m", "--name", "b"))
    gw = gateway(*urls(a, b))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("h1", tokens=3),
            metadata=model_md("m", ("x-sim-ttft-ms", "1500"), ("x-sim-headers-first", "1")),
            timeout=8,
        )
        # The worker has sent its headers and now waits for its first token: kill it.
        first = dict(await call.initial_metadata())["x-sim-worker"]
        {"a": a, "b": b}[first].kill()
        messages, error = await collect(call)
    # No response message had reached the client: the contract says retry elsewhere.
    assert error is None, (error.code(), error.details()) if error else None
    assert len(messages) == 4
    assert messages[-1].complete.finish_reason == "length"
    [event] = wait_for_events(gw.log_path, 1, rpc="Generate")
    assert event["attempts"] == 2
    assert event["worker"] == ({"a": b, "b": a}[first]).address
