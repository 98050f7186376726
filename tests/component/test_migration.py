"""Migration, in process: a Generate stream whose worker fails after tokens reached the
client goes on on another worker, and the client reads one uninterrupted stream (the
simulator's output continues like a greedy model's, so the tokens can be compared with
an uninterrupted run): SGLang, vLLM, a disaggregated pair, each choice of a split request,
an abort reaching it where it went on. Each case where it cannot go on ends as it would
without migration, with the reason logged and counted. (Workers killed with SIGKILL, and
a rolling restart: tests/e2e/test_migration.py; the edge cases:
tests/component/test_migration_edge_cases.py.)

Two calls run at once over two workers placed round robin, so one of them lands on the
worker that fails (whichever that is) and the other is the control."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from gateway_sim.client import collect, model_md, sgl, sgl_grpc, vllm, vllm_grpc, wait_idle
from gateway_sim.model import output_tokens
from tests.support.inproc import Sim, client, gateway, idle, recorded, sim, worker
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
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)

ONE_MIGRATION: dict[str, Any] = {"migration.max_migrations": 1}


def vllm_request(request_id: str, tokens: int = TOKENS) -> Any:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm.SamplingParams(max_tokens=tokens),
        stream=True,
    )


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
