"""Tenant rate limits in process: a tenant past its requests or tokens per minute is
RATE_LIMITED with the time its budget allows the call; tokens are reserved at admission
and settled from the completion tokens the worker reported; a call the gateway refused
itself costs its tenant nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from structlog.testing import capture_logs

from gateway.app.server import Gateway
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.helpers import assert_verdict
from tests.support.inproc import client, gateway, idle, recorded, sim
from tests.support.waits import until

API_KEYS = {"alice": "alice-secret-key-0123456789", "bob": "bob-secret-key-0123456789"}


@asynccontextmanager
async def limited(tenants: dict[str, Any], **overrides: Any) -> AsyncIterator[tuple[Gateway, Any]]:
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), tenants=tenants, **overrides) as gw,
        client(gw) as ch,
    ):
        yield gw, sgl_grpc.SglangSchedulerStub(ch)


def unbounded_output(request_id: str) -> Any:
    """A call that does not say how much it may generate: the gateway reserves an
    estimate (256 tokens), the worker generates its default."""
    return sgl.GenerateRequest(
        request_id=request_id, tokenized=sgl.TokenizedInput(input_ids=[1, 2, 3]), stream=True
    )


async def test_the_call_past_requests_per_minute_is_rate_limited_with_when_it_fits() -> None:
    async with limited({"default": {"requests_per_minute": 2}}) as (gw, stub):
        for i in range(2):
            _, error = await collect(stub.Generate(sgl_generate(f"ok{i}"), metadata=model_md("m")))
            assert error is None
        _, error = await collect(stub.Generate(sgl_generate("third"), metadata=model_md("m")))
        assert error is not None
        # Two used at t0: the next request comes back 30 s after the first (up to the
        # milliseconds the two calls took).
        retry_ms = int(dict(error.trailing_metadata())["grpc-retry-pushback-ms"])
        assert 29_000 < retry_ms <= 30_000
        assert_verdict(
            error,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "RATE_LIMITED",
            "Tenant 'default' is over its rate limit (requests_per_minute 2); "
            f"its budget allows this call in {retry_ms} ms",
            {
                "model": "m",
                "leg": "",
                "httpStatus": "429",
                "code": "rate_limited",
                "tenant": "default",
                "limit": "requests_per_minute",
            },
            retry_s=30,
            pushback_ms=retry_ms,
            retry_ms_exact=True,
        )
        await idle(gw)
        sample = gw.parts.metrics.prometheus.get_sample_value
        labels = {"model": "m", "reason": "RATE_LIMITED", "leg": ""}
        assert sample("gateway_verdicts_total", labels) == 1


async def test_tokens_are_settled_from_the_reported_completion_not_the_estimate() -> None:
    """600 tokens a minute; each call reserves 3 + 256 but the worker generates its
    default few: settled, ten calls fit (unsettled, the third would not)."""
    async with limited({"default": {"tokens_per_minute": 600}}) as (gw, stub):
        for i in range(10):
            _, error = await collect(
                stub.Generate(unbounded_output(f"c{i}"), metadata=model_md("m"))
            )
            assert error is None, (i, error)
        await idle(gw)


async def test_a_call_larger_than_its_budget_now_is_refused_by_tokens() -> None:
    async with limited({"default": {"tokens_per_minute": 100}}) as (gw, stub):
        _, error = await collect(
            stub.Generate(sgl_generate("a", tokens=90), metadata=model_md("m"))
        )
        assert error is None  # 93 reserved, 3 + 90 used
        _, error = await collect(
            stub.Generate(sgl_generate("b", tokens=50), metadata=model_md("m"))
        )
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        info = dict(error.trailing_metadata())
        assert info["x-http-status"] == "429"
        assert "(tokens_per_minute 100)" in (error.details() or "")
        await idle(gw)


async def test_tenants_are_their_principals_each_with_its_own_budget(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in API_KEYS.items()))
    tenants = {"alice": {"requests_per_minute": 1}, "default": {"requests_per_minute": 5}}
    async with limited(tenants, **{"auth.api_keys_file": str(keys)}) as (gw, stub):

        def md(name: str) -> tuple[tuple[str, str | bytes], ...]:
            return model_md("m", ("authorization", f"Bearer {API_KEYS[name]}"))

        _, error = await collect(stub.Generate(sgl_generate("a1"), metadata=md("alice")))
        assert error is None
        _, error = await collect(stub.Generate(sgl_generate("a2"), metadata=md("alice")))
        assert error is not None and "Tenant 'alice'" in (error.details() or "")
        for i in range(3):  # bob has default's limits, in a bucket of his own
            _, error = await collect(stub.Generate(sgl_generate(f"b{i}"), metadata=md("bob")))
            assert error is None
        await idle(gw)


async def test_a_call_refused_by_a_full_queue_costs_its_tenant_nothing() -> None:
    """Three requests a minute: one runs, one waits, and the calls that find the queue
    full get their request back, so each of them is QUEUE_FULL, never RATE_LIMITED."""
    hold = ("x-sim-ttft-ms", "30000")
    async with limited(
        {"default": {"requests_per_minute": 3}},
        models={"m": {"max_inflight": 1}},
        flow={"queue": {"max_requests": 1}},
    ) as (gw, stub):
        rooms = gw.parts.rooms
        assert rooms is not None
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", hold))
        await until(lambda: len(gw.parts.inflight) == 1)
        queued = stub.Generate(sgl_generate("queued"), metadata=model_md("m"))
        await until(lambda: rooms.waiting("m") == 1)
        for i in range(3):
            _, error = await collect(stub.Generate(sgl_generate(f"x{i}"), metadata=model_md("m")))
            assert error is not None
            assert dict(error.trailing_metadata())["x-http-status"] == "429"
            assert (error.details() or "").startswith("Every worker for model 'm' is busy")
        held.cancel()
        await collect(queued)
        await idle(gw)


async def test_a_workers_impossible_usage_counts_as_the_calls_bound_and_is_counted() -> None:
    """A worker that reports 2^32-1 completion tokens for a call that may generate 2 x 4:
    the call is settled as 8 (with 3 prompt tokens), the figure counted and logged as
    rejected, and its tenant keeps its budget, not a debt of days."""
    lie = ("x-sim-completion-tokens", str(2**32 - 1))
    tenants = {"default": {"tokens_per_minute": 1000}}
    async with limited(tenants) as (gw, stub):
        records = recorded(gw)
        with capture_logs() as logs:
            for i in range(3):
                call = stub.Generate(sgl_generate(f"lie{i}", n=2), metadata=model_md("m", lie))
                _, error = await collect(call)
                assert error is None, (i, error)
        await idle(gw)
        assert [r.completion_tokens for r in records] == [8, 8, 8]
        assert all(r.usage_rejected == ("completion_tokens",) for r in records)
        sample = gw.parts.metrics.prometheus.get_sample_value
        labels = {"model": "m", "figure": "completion_tokens"}
        assert sample("gateway_worker_usage_rejected_total", labels) == 3
        rejected = [e for e in logs if e.get("event") == "worker_usage_rejected"]
        assert rejected and rejected[0]["counted_completion_tokens"] == 8
        # 3 x 11 of 1000 used: the next call fits at once.
        _, error = await collect(stub.Generate(sgl_generate("honest"), metadata=model_md("m")))
        assert error is None
        await idle(gw)
