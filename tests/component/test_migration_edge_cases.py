"""Migration's edge cases, in process: the streams of a worker removed from the fleet, a
client's cancel (never migrated), what the tenant is charged, the event on the call's
span, a continuation the new worker refuses, and answers the gateway cannot decode (from
the first worker or from the one the stream went on on)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway.app.server import Gateway
from gateway_sim.client import SGL, collect, model_md, sgl_grpc, wait_idle
from gateway_sim.hostile import Hostile, hostile
from gateway_sim.model import output_tokens
from tests.support.inproc import client, gateway, idle, recorded, sim, worker
from tests.support.migration import (
    FAILS,
    PROMPT,
    TOKENS,
    both,
    migrated,
    migration_lines,
    migrations,
    sgl_request,
    tokens_of,
    two_workers,
    url,
)
from tests.support.tracing import receiver
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)


async def test_a_removed_workers_streams_go_on_instead_of_hanging() -> None:
    slow = ("--token-ms", "5")
    async with two_workers(slow, slow) as (a, b, gw, ch):
        records = recorded(gw)
        stub = sgl_grpc.SglangSchedulerStub(ch)
        running = asyncio.ensure_future(both(stub, sgl_request))
        await until(lambda: worker(gw, a).inflight == 1 and worker(gw, b).inflight == 1)
        emptied = await gw.parts.fleet.remove(worker(gw, a), 0.05)  # its drain times out
        assert not emptied
        for messages, error in await running:
            assert error is None
            assert tokens_of(messages) == output_tokens(PROMPT, TOKENS)
        await until(lambda: len(records) == 2)
        [record] = migrated(records)
        assert record.migrations == [("worker_removed", "continued")]
        assert migrations(gw, "worker_removed", "continued") == 1
        await idle(gw)


async def test_a_removed_workers_stream_that_cannot_go_on_ends_at_once() -> None:
    async with (
        sim("--model", "m", "--name", "a", "--token-ms", "5") as a,
        gateway(url(a)) as gw,
        client(gw) as ch,
    ):
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_request("r1"), metadata=model_md("m"))
        running = asyncio.ensure_future(collect(call))
        await until(lambda: worker(gw, a).inflight == 1)
        await gw.parts.fleet.remove(worker(gw, a), 0.05)
        messages, error = await running  # ended with a status, never left open
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        assert "left service" in (error.details() or "")
        assert 0 < len(messages) < TOKENS


async def test_a_client_cancel_is_never_migrated() -> None:
    async with two_workers(("--token-ms", "5"), ("--token-ms", "5")) as (a, b, gw, ch):
        records = recorded(gw)
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_request("r1"), metadata=model_md("m"))
        async for _ in call:
            break
        call.cancel()
        await until(lambda: len(records) == 1)
        assert records[0].code == "CANCELLED" and records[0].migrations == []
        await idle(gw)
        assert await wait_idle(a.address) == await wait_idle(b.address) == 0


async def test_a_tenant_is_charged_what_it_received_and_the_resent_prompt() -> None:
    """130 tokens a minute; two calls of 3 + 50 at once, one of them migrated 20 tokens
    in: 53 + (53 + 23 re-sent) = 129 used, so a call of 13 more is over the budget (it
    would fit if the re-sent prompt were not charged: 106 used)."""
    async with two_workers(FAILS, (), tenants={"default": {"tokens_per_minute": 130}}) as (
        _a,
        _b,
        gw,
        ch,
    ):
        records = recorded(gw)
        stub = sgl_grpc.SglangSchedulerStub(ch)
        results = await both(stub, lambda i: sgl_request(i, 50))
        assert [error for _, error in results] == [None, None]
        await until(lambda: len(records) == 2)
        assert sorted(r.resent_tokens for r in records) == [0, len(PROMPT) + 20]
        _, error = await collect(stub.Generate(sgl_request("r3", 10), metadata=model_md("m")))
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        await idle(gw)


async def test_a_migration_is_an_event_on_the_calls_span() -> None:
    async with receiver() as (kept, _, port):
        tracing = {"endpoint": f"http://127.0.0.1:{port}", "schedule_delay_ms": 20}
        async with two_workers(FAILS, (), tracing=tracing) as (a, _b, gw, ch):
            results = await both(sgl_grpc.SglangSchedulerStub(ch), sgl_request)
            assert [error for _, error in results] == [None, None]
            await idle(gw)
            await until(lambda: len(kept.named("sglang")) == 2)
    events = [e for span in kept.named("sglang") for e in span.events if e.name == "migration"]
    [event] = events
    found = {kv.key: kv.value for kv in event.attributes}
    assert found["gateway.migration.cause"].string_value == "unavailable"
    assert found["gateway.migration.outcome"].string_value == "continued"
    assert found["gateway.migration.relayed_tokens"].int_value == 20
    assert found["gateway.worker"].string_value == a.address


async def test_a_continuation_the_new_worker_refuses_ends_with_what_broke_the_stream() -> None:
    refuses = ("--fail-code", "INVALID_ARGUMENT", "--fail-after", "0")
    async with two_workers(FAILS, refuses) as (_a, _b, gw, ch):
        records = recorded(gw)
        results = await both(sgl_grpc.SglangSchedulerStub(ch), sgl_request)
        codes = sorted(error.code().name for _, error in results if error is not None)
        assert codes == ["INVALID_ARGUMENT", "UNAVAILABLE"]  # b's own call; a's stream
        [broken] = [m for m, e in results if e is not None and e.code().name == "UNAVAILABLE"]
        assert len(broken) == 20
        await until(lambda: len(records) == 2)
        [record] = migrated(records)
        assert record.migrations == [
            ("unavailable", "continued"),
            ("unavailable", "refused_by_worker"),
        ]
        await idle(gw)


async def raw_generate(ch: aio.Channel, tokens: int) -> tuple[list[bytes], str]:
    """A Generate as a client that does not decode its answers reads it: the bytes of
    each answer, and the status."""
    call = ch.unary_stream(SGL + "Generate")(
        sgl_request("r1", tokens, prompt=[1]).SerializeToString(), metadata=model_md("m")
    )
    messages, error = await collect(call)
    return messages, "OK" if error is None else error.code().name


def kept(gw: Gateway) -> int:
    return gw.parts.migrations.budget.held


async def test_an_undecodable_answer_reaches_the_client_as_a_direct_client_gets_it() -> None:
    """Read with the next batch (past KEEP_BYTES), the garbage ends the stream's
    following, not the stream: the client reads every byte, and OK."""
    worker_ = Hostile(garbage_at={0: 3})
    async with hostile(worker_), gateway(worker_.url()) as gw, client(gw) as ch:
        async with aio.insecure_channel(worker_.address) as direct:
            expected = await raw_generate(direct, 2_000)
        assert expected[1] == "OK" and len(expected[0]) == 2_001
        assert await raw_generate(ch, 2_000) == expected
        assert gw.parts.migrations.budget.unfollowed == {"undecodable": 1}
        await idle(gw)
        assert kept(gw) == 0


async def test_a_stream_whose_worker_sent_garbage_cannot_go_on() -> None:
    behaviour: dict[str, Any] = {"garbage_at": {0: 3}, "fail_at": {0: 6}}
    async with (
        hostile(Hostile(**behaviour)) as a,
        hostile(Hostile(**behaviour)) as b,
        gateway(a.url(), b.url()) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        async with aio.insecure_channel(a.address) as direct:
            expected = await raw_generate(direct, 20)
        with capture_logs() as logs:
            assert await raw_generate(ch, 20) == expected  # 6 answers, then UNAVAILABLE
        await until(lambda: len(records) == 1)
        assert records[0].migrations == [("unavailable", "undecodable")]
        [line] = migration_lines(logs, "migration_refused")
        assert line["outcome"] == "undecodable"
        await idle(gw)
        assert kept(gw) == 0


async def test_an_undecodable_continuation_answer_is_its_workers_failure() -> None:
    """Each worker fails the client's stretch after 5 answers and sends garbage as the
    4th answer of the first continuation: that continuation fails (INTERNAL, the
    worker's, logged) and the stream goes on on the other worker, no token lost."""
    behaviour: dict[str, Any] = {"fail_at": {0: 5}, "garbage_at": {1: 3}}
    async with (
        hostile(Hostile(**behaviour)) as a,
        hostile(Hostile(**behaviour)) as b,
        gateway(a.url(), b.url()) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        with capture_logs() as logs:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_request("r1", 20, prompt=[1]),
                metadata=model_md("m"),
            )
            messages, error = await collect(call)
        assert error is None
        assert tokens_of(messages) == list(range(100, 120))  # none twice, none lost
        await until(lambda: len(records) == 1)
        assert records[0].migrations == [
            ("unavailable", "continued"),
            ("undecodable", "continued"),
        ]
        causes = [line["cause"] for line in migration_lines(logs, "migration")]
        assert causes == ["unavailable", "undecodable"]
        await idle(gw)
        assert kept(gw) == 0
