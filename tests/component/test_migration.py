"""Migration, in process: a Generate stream whose worker fails after tokens reached the
client goes on on another worker, and the client reads one uninterrupted stream (the
simulator's output continues like a greedy model's, so the tokens can be compared with
an uninterrupted run). Each case where it cannot go on ends as it would without
migration, with the reason logged and counted. (Workers killed with SIGKILL, and a
rolling restart: tests/e2e/test_migration.py.)

Two calls run at once over two workers placed round robin, so one of them lands on the
worker that fails (whichever that is) and the other is the control."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway.app.server import Gateway
from gateway.observability.record import CallRecord
from gateway_sim.client import SGL, collect, model_md, sgl, sgl_grpc, vllm, vllm_grpc, wait_idle
from gateway_sim.hostile import Hostile, hostile
from gateway_sim.model import output_tokens
from tests.support.inproc import Sim, client, gateway, idle, recorded, sim, worker
from tests.support.tracing import receiver
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)

PROMPT = [1, 2, 3]
TOKENS = 200
FAILS = ("--fail-code", "UNAVAILABLE", "--fail-after", "20")
ONE_MIGRATION: dict[str, Any] = {"migration.max_migrations": 1}


def sgl_request(request_id: str, tokens: int = TOKENS, **extra: Any) -> Any:
    sampling = extra.pop("sampling", {})
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=extra.pop("prompt", PROMPT)),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens, **sampling),
        stream=True,
        **extra,
    )


def vllm_request(request_id: str, tokens: int = TOKENS) -> Any:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm.SamplingParams(max_tokens=tokens),
        stream=True,
    )


def url(worker: Sim, runtime: str = "sglang", **query: str) -> str:
    return worker.url(model="m", runtime=runtime, **query)


def tokens_of(messages: Sequence[Any]) -> list[int]:
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]


def migration_lines(logs: Sequence[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e.get("event") == event]


@contextlib.asynccontextmanager
async def two_workers(
    a_flags: Sequence[str], b_flags: Sequence[str], **config: Any
) -> AsyncIterator[tuple[Sim, Sim, Gateway, aio.Channel]]:
    """Simulated SGLang workers `a` and `b` of model m (with their flags) behind a gateway
    (with `config`), and a client channel to it."""
    async with (
        sim("--model", "m", "--name", "a", *a_flags) as a,
        sim("--model", "m", "--name", "b", *b_flags) as b,
        gateway(url(a), url(b), **config) as gw,
        client(gw) as ch,
    ):
        yield a, b, gw, ch


def migrations(gw: Gateway, reason: str, outcome: str) -> float:
    labels = {"model": "m", "reason": reason, "outcome": outcome}
    return gw.parts.metrics.prometheus.get_sample_value("gateway_migrations_total", labels) or 0.0


async def both(stub: Any, make: Any) -> list[Any]:
    """Two calls at once (`r1`, `r2`): each one's messages and error."""
    calls = [stub.Generate(make(f"r{i}"), metadata=model_md("m")) for i in (1, 2)]
    return list(await asyncio.gather(*(collect(c) for c in calls)))


def migrated(records: Sequence[CallRecord]) -> list[CallRecord]:
    return [r for r in records if r.migrations]


async def test_an_sglang_stream_goes_on_where_its_worker_failed() -> None:
    async with two_workers(FAILS, ()) as (a, b, gw, ch):
        records = recorded(gw)
        with capture_logs() as logs:
            results = await both(sgl_grpc.SglangSchedulerStub(ch), sgl_request)
        for (messages, error), request_id in zip(results, ("r1", "r2"), strict=True):
            assert error is None
            assert tokens_of(messages) == output_tokens(PROMPT, TOKENS)  # none twice or lost
            chunks = [m.chunk for m in messages[:-1]]
            assert [c.completion_tokens for c in chunks] == list(range(1, TOKENS + 1))
            assert {c.prompt_tokens for c in chunks} == {len(PROMPT)}
            assert {m.request_id for m in messages} == {request_id}
            done = messages[-1].complete
            assert (done.completion_tokens, done.prompt_tokens) == (TOKENS, len(PROMPT))
            assert done.finish_reason == "length"
        await until(lambda: len(records) == 2)
        [record] = migrated(records)
        assert record.migrations == [("unavailable", "continued")]
        assert record.code == "OK" and record.completion_tokens == TOKENS
        assert record.legs[next(iter(record.legs))] == [a.address, b.address]
        assert record.worker == b.address
        assert record.resent_tokens == len(PROMPT) + 20
        assert record.log_fields()["migrations"] == 1
        [line] = migration_lines(logs, "migration")
        assert (line["cause"], line["relayed_tokens"], line["worker"]) == (
            "unavailable",
            20,
            a.address,
        )
        assert migrations(gw, "unavailable", "continued") == 1
        await idle(gw)
        assert await wait_idle(a.address) == await wait_idle(b.address) == 0


async def test_a_vllm_stream_goes_on_where_its_worker_failed() -> None:
    async with (
        sim("--runtime", "vllm", "--model", "m", "--name", "a", *FAILS) as a,
        sim("--runtime", "vllm", "--model", "m", "--name", "b") as b,
        gateway(url(a, "vllm"), url(b, "vllm")) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        results = await both(vllm_grpc.VllmEngineStub(ch), vllm_request)
        for messages, error in results:
            assert error is None
            assert tokens_of(messages) == output_tokens(PROMPT, TOKENS)
            chunks = [m.chunk for m in messages if m.HasField("chunk")]
            assert {c.completion_tokens for c in chunks} == {1}  # vLLM's deltas
            assert {c.prompt_tokens for c in chunks} == {len(PROMPT)}
            assert messages[-1].complete.finish_reason == "length"
        await until(lambda: len(records) == 2)
        [record] = migrated(records)
        assert record.migrations == [("unavailable", "continued")]
        assert record.completion_tokens == TOKENS
        await idle(gw)


REFUSALS = [
    ("constrained", {"sampling": {"regex": "[0-9]+"}}, {}),
    ("prompt_logprobs", {"return_logprob": True}, {}),
    ("choices", {"sampling": {"n": 2}}, {}),
    ("too_long", {}, {"migration.max_resent_tokens": 10}),
    ("disabled", {}, {"migration.enabled": False}),
    ("budget", {}, {"migration.max_kept_tokens": 10}),  # the process's, past 20 relayed
]


@pytest.mark.parametrize(("reason", "extra", "config"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_a_stream_that_cannot_go_on_ends_as_it_would_without_migration(
    reason: str, extra: dict[str, Any], config: dict[str, Any]
) -> None:
    async with two_workers(FAILS, (), **config) as (a, _b, gw, ch):
        records = recorded(gw)
        with capture_logs() as logs:
            results = await both(
                sgl_grpc.SglangSchedulerStub(ch), lambda i: sgl_request(i, **extra)
            )
        failed = [(m, e) for m, e in results if e is not None]
        [(messages, error)] = failed
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert error.details() == "simulated failure"
        assert len(messages) == 20  # what the worker sent before it failed, as without
        await until(lambda: len(records) == 2)
        [record] = migrated(records)
        assert record.migrations == [("unavailable", reason)]
        assert record.code == "UNAVAILABLE" and record.worker == a.address
        [line] = migration_lines(logs, "migration_refused")
        assert (line["outcome"], line["cause"]) == (reason, "unavailable")
        assert migrations(gw, "unavailable", reason) == 1
        await idle(gw)


async def test_a_stream_goes_on_at_most_max_migrations_times() -> None:
    async with (
        sim("--model", "m", "--name", "a", *FAILS) as a,
        sim("--model", "m", "--name", "b", *FAILS) as b,
        sim("--model", "m", "--name", "c", *FAILS) as c,
        gateway(url(a), url(b), url(c), **ONE_MIGRATION) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_request("r1"), metadata=model_md("m"))
        messages, error = await collect(call)
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        assert tokens_of(messages) == output_tokens(PROMPT, 40)  # 20 each, then the limit
        await until(lambda: len(records) == 1)
        assert records[0].migrations == [("unavailable", "continued"), ("unavailable", "limit")]
        await idle(gw)


async def test_a_stream_with_no_other_worker_ends_with_its_workers_status() -> None:
    async with (
        sim("--model", "m", "--name", "a", *FAILS) as a,
        gateway(url(a)) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_request("r1"), metadata=model_md("m"))
        messages, error = await collect(call)
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        assert error.details() == "simulated failure" and len(messages) == 20
        await until(lambda: len(records) == 1)
        assert records[0].migrations == [("unavailable", "unplaced")]
        await idle(gw)


def pd_urls(prefill: Sim, decodes: Sequence[Sim], runtime: str = "sglang") -> list[str]:
    query: dict[str, Any] = {"role": "prefill"}
    if "bootstrap" in prefill.side:
        query["bootstrap_port"] = prefill.side["bootstrap"]
    return [url(prefill, runtime, **query), *(url(d, runtime, role="decode") for d in decodes)]


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
async def test_a_disaggregated_stream_goes_on_on_a_new_pair(runtime: str) -> None:
    role = ("--runtime", runtime, "--model", "m", "--role")
    async with (
        sim(*role, "prefill") as prefill,
        sim(*role, "decode", "--name", "d1", *FAILS) as d1,
        sim(*role, "decode", "--name", "d2") as d2,
        gateway(*pd_urls(prefill, [d1, d2], runtime)) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        if runtime == "sglang":
            results = await both(sgl_grpc.SglangSchedulerStub(ch), sgl_request)
        else:
            results = await both(vllm_grpc.VllmEngineStub(ch), vllm_request)
        for messages, error in results:
            assert error is None
            assert tokens_of(messages) == output_tokens(PROMPT, TOKENS)
        await until(lambda: len(records) == 2)
        [record] = migrated(records)
        assert record.migrations == [("unavailable", "continued")]
        decode_legs = [w for leg, ws in record.legs.items() if leg.value == "decode" for w in ws]
        assert decode_legs == [d1.address, d2.address]
        prefill_legs = [w for leg, ws in record.legs.items() if leg.value == "prefill" for w in ws]
        assert prefill_legs == [prefill.address] * 2  # a new pair: the prefill again
        if runtime == "sglang":
            assert len(set(record.rooms)) == 2  # a new bootstrap room
        await idle(gw)


async def test_each_choice_of_a_split_request_goes_on_on_its_own() -> None:
    role = ("--model", "m", "--role")
    async with (
        sim(*role, "prefill") as prefill,
        sim(*role, "decode", "--name", "d1", *FAILS) as d1,
        sim(*role, "decode", "--name", "d2") as d2,
        gateway(*pd_urls(prefill, [d1, d2])) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        request = sgl_request("r1", 50, sampling={"n": 2})
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(request, metadata=model_md("m"))
        messages, error = await collect(call)
        assert error is None
        for index in (0, 1):
            mine = [m for m in messages if m.WhichOneof("response") and getattr(
                m, m.WhichOneof("response")).index == index]  # fmt: skip
            assert tokens_of(mine) == output_tokens(PROMPT, 50)
            assert mine[-1].complete.completion_tokens == 50
        await until(lambda: len(records) == 1)
        assert records[0].migrations == [("unavailable", "continued")]
        await idle(gw)


async def test_an_abort_reaches_a_stream_where_it_went_on() -> None:
    slow = ("--token-ms", "20", "--abort-completes")  # the aborted stream ends: it is waited on
    fails_early = (*slow, "--fail-code", "UNAVAILABLE", "--fail-after", "3")
    async with two_workers(fails_early, slow) as (_a, b, gw, ch):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with capture_logs() as logs:
            calls = {
                f"r{i}": stub.Generate(sgl_request(f"r{i}"), metadata=model_md("m")) for i in (1, 2)
            }
            running = {i: asyncio.ensure_future(collect(c)) for i, c in calls.items()}
            await until(lambda: bool(migration_lines(logs, "migration")))
            [line] = migration_lines(logs, "migration")
            moved = line["request_id"]
            await until(lambda: worker(gw, b).inflight == 2)  # the continuation runs on b
            reply = await stub.Abort(sgl.AbortRequest(request_id=moved), metadata=model_md("m"))
            assert reply.success
            messages, error = await running[moved]
        assert error is None
        assert messages[-1].complete.finish_reason == "abort"
        assert len(tokens_of(messages)) < TOKENS
        for other in set(calls) - {moved}:
            calls[other].cancel()
            await asyncio.gather(running[other], return_exceptions=True)
        await idle(gw)


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
    return gw.parts.migrations.budget.kept


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
