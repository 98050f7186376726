"""Overload through the front, in process (tests/component/harness): a burst wider than
the fleet's in-flight limit is served or shed with WORKERS_OVERLOADED, never queued into
a hang; a worker whose own load report says it is overloaded is shed (or avoided) within
two load intervals. The subject is placement against in-flight counts and load reports,
which the calls reach over real gRPC connections either way (these were end-to-end
tests; in process their timed parts no longer wait for processes to start).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway_sim.client import (
    channel,
    collect,
    list_workers,
    model_md,
    running_on_sim,
    sgl_generate,
    sgl_grpc,
    trailers,
    wait_idle,
)
from tests.support.availability import is_ready, wait_worker
from tests.support.helpers import rich_status
from tests.support.inproc import Sim, client, gateway, sim
from tests.support.waits import until


def url(worker: Sim, model: str) -> str:
    return worker.url(model=model, runtime="sglang")


def assert_overloaded(error: aio.AioRpcError, model: str, available: int, retry_ms: int) -> None:
    """The WORKERS_OVERLOADED verdict, exactly: RetryInfo is the load poll interval."""
    message = f"All {available} available regular workers for model '{model}' are overloaded"
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == message
    status, details = rich_status(error)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert status.message == message
    info = details["ErrorInfo"]
    assert info.reason == "WORKERS_OVERLOADED"
    assert info.domain == "model-gateway.grpc"
    assert dict(info.metadata) == {
        "model": model,
        "leg": "regular",
        "httpStatus": "429",
        "code": "workers_overloaded",
    }
    assert details["RetryInfo"].retry_delay.ToMilliseconds() == retry_ms
    plain = trailers(error)
    assert plain["x-http-status"] == "429"
    assert plain["grpc-retry-pushback-ms"] == str(retry_ms)
    assert plain["retry-after"] == str(max(1, -(-retry_ms // 1000)))


# Serial from its start: run_alone() mid-test would block this event loop (gateway and
# workers included) while it waits; the shed answers are timed.
@pytest.mark.serial
async def test_burst_six_times_the_fleet_limit_is_served_or_shed() -> None:
    """Issue figure 5: 2 workers x max_inflight 3 = 6 in flight; 36 concurrent streams."""
    # A load interval unlike retry_after_ms (1 s), so RetryInfo shows where it comes from.
    limits: dict[str, Any] = {"models": {"m": {"max_inflight": 3}}, "loads.interval_s": 2.0}
    # The served calls hold their slots far longer than shedding can take, even on a busy
    # machine: a shed answer that came after a slot freed would have been served instead.
    width, tokens, ttft_ms = 36, 3, 5000

    async def one(stub: Any, i: int) -> tuple[float, list[Any], aio.AioRpcError | None, int]:
        started = time.monotonic()
        call = stub.Generate(
            sgl_generate(f"burst-{i}", tokens=tokens),
            metadata=model_md("m", ("x-sim-ttft-ms", str(ttft_ms))),
            timeout=30,
        )
        messages, error = await collect(call)
        headers = len(await call.initial_metadata())
        return time.monotonic() - started, messages, error, headers

    with capture_logs() as logs:
        async with (
            sim("--model", "m", "--name", "a") as a,
            sim("--model", "m", "--name", "b") as b,
            gateway(url(a, "m"), url(b, "m"), **limits) as gw,
            client(gw) as ch,
        ):
            admin = f"127.0.0.1:{gw.admin_port}"
            stub = sgl_grpc.SglangSchedulerStub(ch)
            began = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(one(stub, i) for i in range(width))), timeout=40
            )
            total = time.monotonic() - began
            served = [r for r in results if r[2] is None]
            shed = [r for r in results if r[2] is not None]
            print(
                f"\n[figure 5] burst of {width}: served {len(served)} "
                f"(slowest {max(r[0] for r in served):.3f}s), shed {len(shed)} "
                f"(slowest answer {max(r[0] for r in shed):.3f}s); all done in {total:.3f}s"
            )
            # Every request is either served in full or shed; the shed ones are refused at
            # once, before the served ones could free a slot, so exactly the fleet's limit
            # is served.
            assert len(served) + len(shed) == width
            assert len(served) == 6
            for _, messages, _, _ in served:
                assert len(messages) == tokens + 1
                assert messages[-1].complete.finish_reason == "length"
            for elapsed, messages, error, headers in shed:
                assert error is not None
                assert messages == []
                assert headers == 0  # Trailers-Only
                assert_overloaded(error, "m", 2, 2000)
                assert elapsed < ttft_ms / 1000

            def burst_events() -> list[Mapping[str, Any]]:
                return [
                    e
                    for e in logs
                    if e.get("event") == "request"
                    and e.get("rpc") == "Generate"
                    and str(e.get("request_id", "")).startswith("burst-")
                ]

            await until(lambda: len(burst_events()) >= width)  # the line follows the reply
            events = burst_events()
            assert sorted(e["code"] for e in events) == ["OK"] * 6 + ["RESOURCE_EXHAUSTED"] * 30
            by_worker = [e["worker"] for e in events if e["code"] == "OK"]
            assert sorted(by_worker) == sorted([a.address] * 3 + [b.address] * 3)
            assert all(
                e["reason"] == "WORKERS_OVERLOADED" and e["attempts"] == 0
                for e in events
                if e["code"] != "OK"
            )

            # Nothing leaked: the gateway's counts and the workers' own are back to zero.
            workers = await list_workers(admin)
            assert [w.inflight for w in workers.values()] == [0, 0]
            assert await wait_idle(a.address) == 0
            assert await wait_idle(b.address) == 0
            # And the fleet takes requests again at once.
            messages, error = await collect(stub.Generate(sgl_generate(), metadata=model_md("m")))
            assert error is None and len(messages) == 5


async def first_answer(
    stub: Any, model: str, want: grpc.StatusCode, within_s: float
) -> tuple[float, aio.AioRpcError | None, list[str]]:
    """Poll with short Generate calls until one ends with `want`: how long that took, that
    call's error, and the codes seen before it."""
    began = time.monotonic()
    codes: list[str] = []
    while True:
        _, error = await collect(stub.Generate(sgl_generate(tokens=1), metadata=model_md(model)))
        code = error.code() if error else grpc.StatusCode.OK
        if code is want:
            return time.monotonic() - began, error, codes
        codes.append(code.name)
        assert time.monotonic() - began < within_s, f"still {codes} after {within_s}s"
        await asyncio.sleep(0.02)


@pytest.mark.serial  # within two load intervals (1 s) of the gateway's start
async def test_worker_reporting_overload_is_shed_within_two_load_intervals() -> None:
    """Issue figure 5, second half: the worker's own GetLoads report decides. `lone` and
    `busy` report 50 waiting requests from the start; `kv` gets busy while the gateway
    runs, from requests sent to it directly (which the gateway cannot count). Timed from
    the gateway's start (`ready=False`: what `gateway serve` printing READY is)."""
    interval = 0.5
    retry_ms = round(interval * 1000)
    settings: dict[str, Any] = {
        "models": {
            "w": {"max_waiting": 10},
            "n": {"max_waiting": 10},
            # `kv` reports KV usage running/256 (its --max-running): three exceed 0.01.
            "k": {"max_token_usage": 0.01},
        },
        "loads.interval_s": interval,
    }
    async with (
        sim("--model", "w", "--name", "lone", "--load-waiting", "50") as lone,
        sim("--model", "n", "--name", "busy", "--load-waiting", "50") as busy,
        sim("--model", "n", "--name", "idle") as idle,
        sim("--model", "k", "--name", "kv", "--max-running", "256") as kv,
        gateway(
            url(lone, "w"), url(busy, "n"), url(idle, "n"), url(kv, "k"), ready=False, **settings
        ) as gw,
        client(gw) as ch,
        channel(kv.address) as direct,
    ):
        admin = f"127.0.0.1:{gw.admin_port}"
        stub = sgl_grpc.SglangSchedulerStub(ch)
        up, shed, before = await first_answer(
            stub, "w", grpc.StatusCode.RESOURCE_EXHAUSTED, 4 * interval
        )
        assert shed is not None
        assert_overloaded(shed, "w", 1, retry_ms)
        # It stays shed while the report says so ...
        for _ in range(3):
            _, error = await collect(stub.Generate(sgl_generate(tokens=1), metadata=model_md("w")))
            assert error is not None
            assert_overloaded(error, "w", 1, retry_ms)
        # ... and a model with a worker to spare avoids the overloaded one instead.
        await wait_worker(admin, idle.address, is_ready)
        for i in range(6):
            call = stub.Generate(sgl_generate(f"n{i}", tokens=1), metadata=model_md("n"))
            messages, error = await collect(call)
            assert error is None, error
            assert len(messages) == 2
            assert dict(await call.initial_metadata())["x-sim-worker"] == "idle"

        # A load that changes: four requests held on `kv` behind the gateway's back.
        await wait_worker(admin, kv.address, is_ready)
        await first_answer(stub, "k", grpc.StatusCode.OK, 1.0)
        hogs = [
            sgl_grpc.SglangSchedulerStub(direct).Generate(
                sgl_generate(f"hog{i}"), metadata=(("x-sim-ttft-ms", "10000"),), timeout=10
            )
            for i in range(4)
        ]
        deadline = time.monotonic() + 2
        while await running_on_sim(kv.address) < 4:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        on, error, _ = await first_answer(
            stub, "k", grpc.StatusCode.RESOURCE_EXHAUSTED, 4 * interval
        )
        assert error is not None
        assert_overloaded(error, "k", 1, retry_ms)
        for hog in hogs:
            hog.cancel()
        assert await wait_idle(kv.address) == 0
        off, _, _ = await first_answer(stub, "k", grpc.StatusCode.OK, 4 * interval)
        print(
            f"\n[figure 5] worker reporting 50 waiting (limit 10) shed {up:.3f}s after the "
            f"gateway was up (answers before: {before}); KV usage over the limit -> shed after "
            f"{on:.3f}s, back under it -> served after {off:.3f}s (load interval {interval}s)"
        )
        assert up <= 2 * interval
        assert on <= 2 * interval
        assert off <= 2 * interval
        reported = (await list_workers(admin))[busy.address]
        assert reported.load.waiting == 50
        assert is_ready(reported)
