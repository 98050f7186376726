"""Worker errors: retry UNAVAILABLE and connection
errors before the first message on another worker, never the same one, within the
attempt budget; every other status, and anything after the first message, passes
through unchanged with the worker's trailing metadata.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway.launch import Child
from tests.conftest import Launcher, worker_url
from tests.e2e.helpers import (
    SharedProcesses,
    channel,
    closed_port,
    collect,
    dead_worker_url,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    start_many,
    trailers,
    wait_for_events,
    wait_health,
    wait_idle,
)


def urls(*children: Child) -> list[str]:
    args: list[str] = []
    for child in children:
        args += ["--worker", worker_url(child, model="m", runtime="sglang")]
    return args


def embed_request(request_id: str = "e1") -> Any:
    return sgl.EmbedRequest(request_id=request_id, tokenized=sgl.TokenizedInput(input_ids=[1, 2]))


@dataclass(frozen=True)
class Workers:
    a: Child  # healthy, named a
    b: Child  # healthy, named b
    bad: tuple[Child, ...]  # three workers failing every Generate/Embed with UNAVAILABLE

    def name_of(self, address: str) -> str:
        names = {self.a.address: "a", self.b.address: "b"}
        names.update({w.address: f"bad{i}" for i, w in enumerate(self.bad)})
        return names[address]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Workers shared by the tests that neither kill nor reconfigure them; each test puts
    its own gateway in front."""
    shared = SharedProcesses(tmp_path_factory.mktemp("retries"))
    try:
        a, b, *bad = shared.sims(
            ("--model", "m", "--name", "a"),
            ("--model", "m", "--name", "b"),
            *[
                ("--model", "m", "--name", f"bad{i}", "--fail-code", "UNAVAILABLE")
                for i in range(3)
            ],
        )
        yield Workers(a, b, tuple(bad))
    finally:
        shared.stop()


async def test_unavailable_worker_is_retried_on_the_other_one(
    workers: Workers, gateway: Launcher
) -> None:
    good, bad = workers.a, workers.bad[0]
    gw = gateway(*urls(good, bad))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(10):
            call = stub.Generate(sgl_generate(f"r{i}", tokens=3), metadata=model_md("m"))
            messages, error = await collect(call)
            assert error is None, error
            assert len(messages) == 4
            assert dict(await call.initial_metadata())["x-sim-worker"] == "a"
        for i in range(2):
            reply = await stub.Embed(embed_request(f"e{i}"), metadata=model_md("m"))
            assert reply.embedding_dim == 8
    log_path = gw.log_path  # type: ignore[attr-defined]
    events = [*wait_for_events(log_path, 10, "Generate"), *wait_for_events(log_path, 2, "Embed")]
    assert len(events) == 12
    assert all(e["code"] == "OK" and e["worker"] == good.address for e in events)
    # Two workers: a retry goes to the other one, so never more than two attempts.
    assert {e["attempts"] for e in events} <= {1, 2}
    assert any(e["attempts"] == 2 for e in events if e["rpc"] == "Generate")


async def test_every_worker_unavailable_ends_with_the_last_workers_status(
    workers: Workers, gateway: Launcher
) -> None:
    budget = gateway(*urls(*workers.bad))
    tight = gateway("--max-attempts", "2", *urls(*workers.bad))
    roomy = gateway("--max-attempts", "5", *urls(*workers.bad))
    # attempts = min(budget, workers): never the same worker twice
    for gw, attempts in ((budget, 3), (tight, 2), (roomy, 3)):
        await wait_health(gw.address, "m")
        async with channel(gw.address) as ch:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("m"))
            messages, error = await collect(call)
        assert messages == []
        assert error is not None
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert error.details() == "simulated failure"
        plain = trailers(error)
        assert "grpc-status-details-bin" not in plain  # the worker's own status, no verdict
        [event] = wait_for_events(gw.log_path, 1, rpc="Generate")  # type: ignore[attr-defined]
        assert event["attempts"] == attempts
        assert event["code"] == "UNAVAILABLE"
        assert workers.name_of(event["worker"]) == plain["x-sim-failure"]  # the last one's


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "FAILED_PRECONDITION"])
async def test_non_retryable_worker_status_passes_through_unchanged(
    workers: Workers, gateway: Launcher, code: str
) -> None:
    gw = gateway(*urls(workers.a, workers.b))
    await wait_health(gw.address, "m")
    failing = model_md("m", ("x-sim-fail-code", code))
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        messages, error = await collect(stub.Generate(sgl_generate(), metadata=failing))
        assert messages == []
        assert error is not None
        with pytest.raises(aio.AioRpcError) as caught:
            await stub.Embed(embed_request(), metadata=failing)
    expected = grpc.StatusCode[code]
    for failure in (error, caught.value):
        assert failure.code() is expected
        assert failure.details() == "simulated failure"
        assert trailers(failure)["x-sim-failure"] in {"a", "b"}
        assert "x-http-status" not in trailers(failure)
    log_path = gw.log_path  # type: ignore[attr-defined]
    events = [*wait_for_events(log_path, 1, "Generate"), *wait_for_events(log_path, 1, "Embed")]
    assert [e["attempts"] for e in events] == [1, 1]
    assert [e["code"] for e in events] == [code, code]
    assert workers.name_of(events[0]["worker"]) == trailers(error)["x-sim-failure"]
    assert workers.name_of(events[1]["worker"]) == trailers(caught.value)["x-sim-failure"]


async def test_unavailable_after_the_first_message_is_not_retried(
    workers: Workers, gateway: Launcher
) -> None:
    gw = gateway(*urls(workers.a, workers.b))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(tokens=8),
            metadata=model_md("m", ("x-sim-fail-code", "UNAVAILABLE"), ("x-sim-fail-after", "2")),
        )
        messages, error = await collect(call)
    assert len(messages) == 2
    assert all(m.HasField("chunk") for m in messages)
    assert error is not None
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert error.details() == "simulated failure"
    assert trailers(error)["x-sim-failure"] in {"a", "b"}
    [event] = wait_for_events(gw.log_path, 1, rpc="Generate")  # type: ignore[attr-defined]
    assert event["attempts"] == 1
    assert event["code"] == "UNAVAILABLE"
    assert await wait_idle(workers.a.address) == 0
    assert await wait_idle(workers.b.address) == 0


async def test_dead_worker_next_to_a_live_one_costs_nothing(
    workers: Workers, gateway: Launcher
) -> None:
    dead = closed_port()  # connection refused, for as long as the test runs
    gw = gateway(*urls(workers.a), "--worker", dead_worker_url(dead, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(10):
            call = stub.Generate(sgl_generate(f"r{i}", tokens=2), metadata=model_md("m"))
            messages, error = await collect(call)
            assert error is None, error
            assert len(messages) == 3
            assert dict(await call.initial_metadata())["x-sim-worker"] == "a"
    events = wait_for_events(gw.log_path, 10, rpc="Generate")  # type: ignore[attr-defined]
    assert all(e["worker"] == workers.a.address and e["code"] == "OK" for e in events)


async def test_worker_killed_while_ready_is_not_felt_by_clients(
    workers: Workers, sim: Launcher, gateway: Launcher
) -> None:
    doomed = sim("--model", "m", "--name", "doomed")
    gw = gateway(*urls(workers.a, doomed))
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


async def test_worker_dying_after_its_headers_but_before_a_message_is_retried(
    sim: Launcher, gateway: Launcher
) -> None:
    a, b = start_many(sim, ("--model", "m", "--name", "a"), ("--model", "m", "--name", "b"))
    gw = gateway(*urls(a, b))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("h1", tokens=3),
            metadata=model_md("m", ("x-sim-ttft-ms", "1500")),
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
    [event] = wait_for_events(gw.log_path, 1, rpc="Generate")  # type: ignore[attr-defined]
    assert event["attempts"] == 2
    assert event["worker"] == ({"a": b, "b": a}[first]).address
