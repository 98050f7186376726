"""The relay's endings: the client's deadline and cancel reaching the worker, a stalled
worker ended at the deadline, a worker dying mid-stream, a mid-stream failure passed
through after the relayed messages (and counted in the request log), and the gateway's
in-flight counts back to zero.

After every cancel, deadline or failure the simulated worker is asked directly
(GetLoads) that nothing stays running there.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc import aio

from gateway_sim.client import (
    SGL_SERVICE,
    channel,
    collect,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    trailers,
    wait_health,
    wait_idle,
    wait_running,
)
from gateway_sim.launch import start_many, worker_url
from tests.support import relay
from tests.support.helpers import wait_for_events
from tests.support.launch import Launcher
from tests.support.relay import Fleet

fleet = relay.fleet  # the fixture (tests/support/relay.py)
ready = relay.ready  # the fixture (tests/support/relay.py)


async def test_client_deadline_reaches_the_worker(ready: Fleet) -> None:
    gw = ready.gateway
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_generate(), metadata=model_md("s"), timeout=2.0)
        _, error = await collect(call)
        assert error is None
        deadline_ms = int(dict(await call.initial_metadata())["x-sim-deadline-ms"])
        # grpc rounds a timeout up as it encodes `grpc-timeout`: a few ms over is fine.
        assert 1000 <= deadline_ms <= 2050

        # No client deadline: none upstream either.
        call = stub.Generate(sgl_generate(), metadata=model_md("s"))
        _, error = await collect(call)
        assert error is None
        assert dict(await call.initial_metadata())["x-sim-deadline-ms"] == "none"


async def test_stalled_worker_ends_at_the_client_deadline(ready: Fleet, strict: bool) -> None:
    """The client's deadline ends the call (its own grpc ends it there; the timing tier
    checks it did so in time) and reaches the worker, which runs nothing after it."""
    worker, gw = ready.sglang, ready.gateway
    async with channel(gw.address) as ch:
        started = time.monotonic()
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(), metadata=model_md("s", ("x-sim-stall", "true")), timeout=1.0
        )
        messages, error = await collect(call)
        elapsed = time.monotonic() - started
    assert messages == []
    assert error is not None
    assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    if strict:
        assert elapsed < 2.5
    assert await wait_idle(worker.address) == 0

    # A cancel while the worker has not even sent its headers reaches it as well.
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(), metadata=model_md("s", ("x-sim-stall", "true"))
        )
        assert await wait_running(worker.address, 1) == 1
        call.cancel()
        assert await wait_idle(worker.address) == 0

        # The unary path (Embed) too.
        started = time.monotonic()
        with pytest.raises(aio.AioRpcError) as caught:
            await sgl_grpc.SglangSchedulerStub(ch).Embed(
                sgl.EmbedRequest(request_id="e-stall", tokenized=sgl.TokenizedInput(input_ids=[1])),
                metadata=model_md("s", ("x-sim-stall", "true")),
                timeout=0.5,
            )
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        if strict:
            assert time.monotonic() - started < 2.0
        assert await wait_idle(worker.address) == 0


async def test_client_cancel_reaches_the_worker(ready: Fleet) -> None:
    worker, gw = ready.sglang, ready.gateway
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("c1", tokens=100), metadata=model_md("s", ("x-sim-token-ms", "50"))
        )
        received = 0
        async for _ in call:
            received += 1
            if received == 2:
                break
        assert await wait_idle(worker.address, within_s=0.1) == 1  # still generating
        call.cancel()
        assert await wait_idle(worker.address) == 0
    [event] = wait_for_events(ready.log_path, 1, "Generate", "c1")
    assert event["code"] == "CANCELLED"


@pytest.mark.sim_processes  # x-sim-exit-after ends the process
async def test_worker_dying_mid_stream_ends_the_stream_unavailable(
    sim: Launcher, gateway: Launcher, strict: bool
) -> None:
    """UNAVAILABLE as the worker dies (not the client's deadline, 10 s; within 3 s in the
    timing tier), after the three messages it sent, with no retry."""
    worker = sim("--runtime", "sglang", "--model", "s")
    gw = gateway("--worker", worker_url(worker, model="s", runtime="sglang"))
    await wait_health(gw.address, "s")
    async with channel(gw.address) as ch:
        started = time.monotonic()
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(tokens=10), metadata=model_md("s", ("x-sim-exit-after", "3")), timeout=10
        )
        messages, error = await collect(call)
        elapsed = time.monotonic() - started
    assert len(messages) == 3
    assert error is not None
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    if strict:
        assert elapsed < 3.0
    [event] = wait_for_events(gw.log_path, 1, rpc="Generate")
    assert event["code"] == "UNAVAILABLE"
    assert event["attempts"] == 1  # after the first message there is no retry


async def test_mid_stream_failure_passes_through_after_the_relayed_messages(ready: Fleet) -> None:
    worker, gw = ready.sglang, ready.gateway
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("mid-1", tokens=10),
            metadata=model_md("s", ("x-sim-fail-code", "INTERNAL"), ("x-sim-fail-after", "3")),
        )
        messages, error = await collect(call)
        headers = dict(await call.initial_metadata())
    assert len(messages) == 3
    assert headers["x-sim-worker"] == "sgl-0"
    assert error is not None
    assert error.code() is grpc.StatusCode.INTERNAL
    assert error.details() == "simulated failure"
    assert trailers(error)["x-sim-failure"] == "sgl-0"
    assert await wait_idle(worker.address) == 0
    [event] = wait_for_events(ready.log_path, 1, "Generate", "mid-1")
    assert (event["code"], event["attempts"]) == ("INTERNAL", 1)


async def test_request_log_counts_messages_relayed_before_a_failure(ready: Fleet) -> None:
    gw = ready.gateway
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("f1", tokens=10),
            metadata=model_md("s", ("x-sim-fail-code", "DATA_LOSS"), ("x-sim-fail-after", "4")),
        )
        messages, error = await collect(call)
    assert len(messages) == 4
    assert error is not None
    assert error.code() is grpc.StatusCode.DATA_LOSS
    [event] = wait_for_events(ready.log_path, 1, "Generate", "f1")
    assert event["code"] == "DATA_LOSS"
    assert event["first_message_ms"] is not None
    assert event["messages"] == 4  # what the client received, not 0


async def test_gateway_in_flight_counts_return_to_zero(sim: Launcher, gateway: Launcher) -> None:
    """least_inflight sends an idle fleet's calls round the workers in turn; a leaked
    in-flight count would make it avoid that worker forever."""
    a, b = start_many(
        sim,
        ("--runtime", "sglang", "--model", "s", "--name", "a"),
        ("--runtime", "sglang", "--model", "s", "--name", "b"),
    )
    gw = gateway(
        "--policy",
        "least_inflight",
        "--worker",
        worker_url(a, model="s", runtime="sglang"),
        "--worker",
        worker_url(b, model="s", runtime="sglang"),
    )
    await wait_health(gw.address, "s")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for _ in range(2):  # twice, so that every kind of ending hits both workers
            stalled = stub.Generate(
                sgl_generate(), metadata=model_md("s", ("x-sim-stall", "1")), timeout=0.3
            )
            _, error = await collect(stalled)
            assert error is not None
            assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED

            cancelled = stub.Generate(
                sgl_generate(tokens=100), metadata=model_md("s", ("x-sim-token-ms", "50"))
            )
            await cancelled.__aiter__().__anext__()
            cancelled.cancel()
            assert await wait_idle(a.address) == 0
            assert await wait_idle(b.address) == 0

            for fail_after in ("0", "1"):
                failing = model_md(
                    "s", ("x-sim-fail-code", "INTERNAL"), ("x-sim-fail-after", fail_after)
                )
                _, error = await collect(stub.Generate(sgl_generate(), metadata=failing))
                assert error is not None
                assert error.code() is grpc.StatusCode.INTERNAL

            _, error = await collect(ch.unary_stream(f"/{SGL_SERVICE}/Generate")(b"\xff\xff"))
            assert error is not None
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT

        order = []
        for i in range(4):
            call = stub.Generate(sgl_generate(f"after-{i}", tokens=1), metadata=model_md("s"))
            _, error = await collect(call)
            assert error is None
            order.append(dict(await call.initial_metadata())["x-sim-worker"])
    assert order in (["a", "b"] * 2, ["b", "a"] * 2), order
