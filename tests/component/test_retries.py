"""Worker errors, in process (tests/component/harness): retry UNAVAILABLE and connection
errors before the first message on another worker, never the same one, within the
attempt budget; every other status, and anything after the first message, passes
through unchanged with the worker's trailing metadata. (A worker killed while ready, or
after its headers: tests/e2e/test_retries.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway.upstream.worker import WorkerStatus
from gateway_sim.client import (
    channel,
    closed_port,
    collect,
    dead_worker_url,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    trailers,
    wait_idle,
)
from tests.support.inproc import Sim, gateway, sim, worker
from tests.support.waits import until

NO_MIGRATION: dict[str, Any] = {"migration.enabled": False}


def url(worker: Sim) -> str:
    return worker.url(model="m", runtime="sglang")


def address(gw: Any) -> str:
    return f"127.0.0.1:{gw.port}"


def embed_request(request_id: str = "e1") -> Any:
    return sgl.EmbedRequest(request_id=request_id, tokenized=sgl.TokenizedInput(input_ids=[1, 2]))


def requests(logs: Sequence[Mapping[str, Any]], rpc: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e.get("event") == "request" and e.get("rpc") == rpc]


async def logged(
    logs: Sequence[Mapping[str, Any]], rpc: str, count: int
) -> list[Mapping[str, Any]]:
    """The request events of `rpc` once `count` are logged (the line follows the reply)."""
    await until(lambda: len(requests(logs, rpc)) >= count)
    return requests(logs, rpc)


@contextlib.asynccontextmanager
async def failing(count: int) -> AsyncIterator[list[Sim]]:
    """`count` workers failing every Generate/Embed with UNAVAILABLE, named bad0, bad1..."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                sim("--model", "m", "--name", f"bad{i}", "--fail-code", "UNAVAILABLE")
            )
            for i in range(count)
        ]


async def test_unavailable_worker_is_retried_on_the_other_one() -> None:
    async with (
        sim("--model", "m", "--name", "a") as good,
        failing(1) as (bad,),
        gateway(url(good), url(bad)) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with capture_logs() as logs:
            for i in range(10):
                call = stub.Generate(sgl_generate(f"r{i}", tokens=3), metadata=model_md("m"))
                messages, error = await collect(call)
                assert error is None, error
                assert len(messages) == 4
                assert dict(await call.initial_metadata())["x-sim-worker"] == "a"
            for i in range(2):
                reply = await stub.Embed(embed_request(f"e{i}"), metadata=model_md("m"))
                assert reply.embedding_dim == 8
            events = [*await logged(logs, "Generate", 10), *await logged(logs, "Embed", 2)]
    assert len(events) == 12
    assert all(e["code"] == "OK" and e["worker"] == good.address for e in events)
    # Two workers: a retry goes to the other one, so never more than two attempts.
    assert {e["attempts"] for e in events} <= {1, 2}
    assert any(e["attempts"] == 2 for e in events if e["rpc"] == "Generate")


@pytest.mark.parametrize(("max_attempts", "attempts"), [(None, 3), (2, 2), (5, 3)])
async def test_every_worker_unavailable_ends_with_the_last_workers_status(
    max_attempts: int | None, attempts: int
) -> None:
    """attempts = min(budget, workers): never the same worker twice (the budget is 3
    unless set)."""
    async with (
        failing(3) as bad,
        gateway(*map(url, bad), max_attempts=max_attempts) as gw,
        channel(address(gw)) as ch,
    ):
        with capture_logs() as logs:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("m"))
            messages, error = await collect(call)
            [event] = await logged(logs, "Generate", 1)
    assert messages == []
    assert error is not None
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert error.details() == "simulated failure"
    plain = trailers(error)
    assert "grpc-status-details-bin" not in plain  # the worker's own status, no verdict
    assert event["attempts"] == attempts
    assert event["code"] == "UNAVAILABLE"
    names = {w.address: w.name for w in bad}
    assert names[event["worker"]] == plain["x-sim-failure"]  # the last one's


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "FAILED_PRECONDITION"])
async def test_non_retryable_worker_status_passes_through_unchanged(code: str) -> None:
    failure_md = model_md("m", ("x-sim-fail-code", code))
    async with (
        sim("--model", "m", "--name", "a") as a,
        sim("--model", "m", "--name", "b") as b,
        gateway(url(a), url(b)) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with capture_logs() as logs:
            messages, error = await collect(stub.Generate(sgl_generate(), metadata=failure_md))
            assert messages == []
            assert error is not None
            with pytest.raises(aio.AioRpcError) as caught:
                await stub.Embed(embed_request(), metadata=failure_md)
            events = [*await logged(logs, "Generate", 1), *await logged(logs, "Embed", 1)]
    expected = grpc.StatusCode[code]
    for failure in (error, caught.value):
        assert failure.code() is expected
        assert failure.details() == "simulated failure"
        assert trailers(failure)["x-sim-failure"] in {"a", "b"}
        assert "x-http-status" not in trailers(failure)
    names = {a.address: "a", b.address: "b"}
    assert [e["attempts"] for e in events] == [1, 1]
    assert [e["code"] for e in events] == [code, code]
    assert names[events[0]["worker"]] == trailers(error)["x-sim-failure"]
    assert names[events[1]["worker"]] == trailers(caught.value)["x-sim-failure"]


async def test_unavailable_after_the_first_message_is_not_retried() -> None:
    """Without migration (tests/component/test_migration.py has it on)."""
    async with (
        sim("--model", "m", "--name", "a") as a,
        sim("--model", "m", "--name", "b") as b,
        gateway(url(a), url(b), **NO_MIGRATION) as gw,
        channel(address(gw)) as ch,
    ):
        with capture_logs() as logs:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_generate(tokens=8),
                metadata=model_md(
                    "m", ("x-sim-fail-code", "UNAVAILABLE"), ("x-sim-fail-after", "2")
                ),
            )
            messages, error = await collect(call)
            [event] = await logged(logs, "Generate", 1)
        assert len(messages) == 2
        assert all(m.HasField("chunk") for m in messages)
        assert error is not None
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert error.details() == "simulated failure"
        assert trailers(error)["x-sim-failure"] in {"a", "b"}
        assert event["attempts"] == 1
        assert event["code"] == "UNAVAILABLE"
        assert await wait_idle(a.address) == 0
        assert await wait_idle(b.address) == 0


async def test_dead_worker_next_to_a_live_one_costs_nothing() -> None:
    dead = closed_port()  # connection refused, for as long as the test runs
    async with (
        sim("--model", "m", "--name", "a") as a,
        gateway(url(a), dead_worker_url(dead, model="m", runtime="sglang"), ready=False) as gw,
        channel(address(gw)) as ch,
    ):
        await until(lambda: worker(gw, a).status is WorkerStatus.READY)
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with capture_logs() as logs:
            for i in range(10):
                call = stub.Generate(sgl_generate(f"r{i}", tokens=2), metadata=model_md("m"))
                messages, error = await collect(call)
                assert error is None, error
                assert len(messages) == 3
                assert dict(await call.initial_metadata())["x-sim-worker"] == "a"
            events = await logged(logs, "Generate", 10)
    dead.close()
    assert all(e["worker"] == a.address and e["code"] == "OK" for e in events)
