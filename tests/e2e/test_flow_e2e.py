"""Flow control through real processes (issue 17): a gateway process with a `flow:` section
in front of simulated workers. Each way a call can leave the queue unserved (QUEUE_FULL,
QUEUE_TIMEOUT) and a tenant's rate limit (RATE_LIMITED) has its test, asserting the answer
the client gets (code, ErrorInfo reason, x-http-status, RetryInfo); a queued call that
leaves (deadline, cancel) never reaches a worker. (SHUTTING_DOWN at the end of a SIGTERM
drain, and a saturated mixed load: tests/e2e/test_flow_e2e_drain_and_load.py.)
In-process tests of the same mechanisms: tests/component/test_flow.py, test_rate_limits.py.

Every wait is on observable state (the call's response headers, ListQueues, ListWorkers,
the request log), bounded."""

from __future__ import annotations

import asyncio
import math
import re
import time
from pathlib import Path
from typing import Any

import grpc

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    list_workers,
    model_md,
    running_on_sim,
    sgl_generate,
    sgl_grpc,
    trailers,
    wait_health,
    wait_idle,
)
from gateway_sim.launch import Child
from tests.support.availability import labels, samples, scrape
from tests.support.flow_e2e import (
    assert_never_placed,
    flow_gateway,
    hold,
    one_event,
    until_waiting,
    waiting,
)
from tests.support.helpers import assert_verdict, wait_for_events
from tests.support.launch import Launcher
from tests.support.waits import until

POLL_S = 0.02
QUEUE_FULL_META = {"model": "m", "leg": "", "httpStatus": "429", "code": "queue_full"}
TIMEOUT_META = {
    "model": "m",
    "leg": "",
    "class": "standard",
    "httpStatus": "429",
    "code": "queue_timeout",
}
TIMEOUT_MESSAGE = re.compile(
    r"Waited (\d+\.\d) s for a worker for model 'm' \(class standard\) "
    r"without one becoming free"
)


async def worker_state(gw: Child) -> Any:
    """The one worker as ListWorkers shows it (inflight, outlier state)."""
    (worker,) = (await list_workers(admin_address(gw))).values()
    return worker


async def flow_outcome(gw: Child, klass: str, outcome: str) -> float:
    """gateway_flow_outcomes_total{class, outcome} from /metrics (0 if absent)."""
    text = await asyncio.to_thread(scrape, gw)
    found = samples(text, "gateway_flow_outcomes_total")
    return found.get(labels(**{"class": klass, "outcome": outcome}), 0.0)


async def test_a_full_queue_is_queue_full_with_retry_info(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """One slot, one place in the queue: the third call is QUEUE_FULL (429, RetryInfo),
    and the one that waited keeps its place and is served once the slot frees."""
    worker = sim("--model", "m", "--headers-first")  # a held call shows by its headers
    settings = {"models": {"m": {"max_inflight": 1}}, "flow": {"queue": {"max_requests": 1}}}
    gw = flow_gateway(gateway, tmp_path, [worker], settings)
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = await hold(stub)
        queued = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("queued"), metadata=model_md("m"), timeout=20))
        )
        await until_waiting(gw, 1)
        call = stub.Generate(sgl_generate("third"), metadata=model_md("m"), timeout=20)
        messages, error = await collect(call)
        assert messages == [] and error is not None
        assert len(await call.initial_metadata()) == 0  # Trailers-Only, as every verdict
        assert_verdict(
            error,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QUEUE_FULL",
            "Every worker for model 'm' is busy and its queue is full "
            "(1 waiting, flow.queue.max_requests 1)",
            QUEUE_FULL_META,
            retry_s=1,
            pushback_ms=1000,
        )
        assert not queued.done()
        held.cancel()
        messages, error = await queued
    assert error is None and len(messages) == 5
    assert_never_placed(one_event(gw, "third"), "RESOURCE_EXHAUSTED")
    assert one_event(gw, "queued")["queued_ms"] > 0


async def test_a_call_waiting_past_its_class_ttl_is_queue_timeout_with_retry_info(
    sim: Launcher, gateway: Launcher, tmp_path: Path, strict: bool
) -> None:
    """A class with a 0.3 s ttl_s: a call that waits that long is QUEUE_TIMEOUT (429,
    RetryInfo), not sooner (and, in the timing tier, not 5 s later), and no worker saw
    it."""
    worker = sim("--model", "m", "--headers-first")  # a held call shows by its headers
    settings = {
        "models": {"m": {"max_inflight": 1}},
        "flow": {"classes": [{"name": "standard", "ttl_s": 0.3}]},
    }
    gw = flow_gateway(gateway, tmp_path, [worker], settings)
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = await hold(stub)
        began = time.monotonic()
        _, error = await collect(
            stub.Generate(sgl_generate("late"), metadata=model_md("m"), timeout=20)
        )
        elapsed = time.monotonic() - began
        held.cancel()
    assert error is not None
    found = TIMEOUT_MESSAGE.fullmatch(error.details() or "")
    assert found is not None, error.details()
    assert float(found[1]) >= 0.3
    if strict:
        assert float(found[1]) < 5.0
    assert elapsed >= 0.3
    assert_verdict(
        error,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "QUEUE_TIMEOUT",
        found[0],
        TIMEOUT_META,
        retry_s=1,
        pushback_ms=1000,
    )
    assert_never_placed(one_event(gw, "late"), "RESOURCE_EXHAUSTED")
    assert await waiting(gw) == 0


async def test_a_deadline_expiring_in_the_queue_is_deadline_exceeded_and_blames_no_worker(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """The client's own deadline passes while its call waits: DEADLINE_EXCEEDED, the
    worker never ran it, and nothing counts against the worker: with outlier detection
    that ejects on one failure, the worker still serves the next call."""
    worker = sim("--model", "m", "--headers-first")  # a held call shows by its headers
    settings = {
        "models": {"m": {"max_inflight": 1}},
        "flow": {},
        "outlier_detection": {"failure_threshold": 1},
    }
    gw = flow_gateway(gateway, tmp_path, [worker], settings)
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = await hold(stub)
        began = time.monotonic()
        late = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("deadline"), metadata=model_md("m"), timeout=1.5))
        )
        await until_waiting(gw, 1)  # it expires in the queue, not on its way there
        _, error = await late
        elapsed = time.monotonic() - began
        assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert elapsed >= 1.4  # the client's own timer
        # The gateway tells a deadline from a cancel by the time left on its own copy of
        # the deadline, which runs from the request's arrival, a little after the
        # client's: on a busy machine the client's RST_STREAM can come first and the call
        # is logged CANCELLED (outcome cancelled). A gateway bug, reported; the client's
        # answer above, and that no worker was called, are exact.
        event = one_event(gw, "deadline")
        assert event["code"] in ("DEADLINE_EXCEEDED", "CANCELLED"), event
        assert_never_placed(event, event["code"])

        async def counted() -> bool:
            ended = [await flow_outcome(gw, "standard", o) for o in ("deadline", "cancelled")]
            return sum(ended) == 1

        await until(counted, what="the deadline outcome counted")  # the log line comes first
        assert await waiting(gw) == 0
        state = await worker_state(gw)
        assert state.inflight == 1  # the held call only
        assert state.breaker_state == admin_pb.BREAKER_STATE_CLOSED
        assert await running_on_sim(worker.address) == 1  # the worker's own count

        held.cancel()
        assert await wait_idle(worker.address) == 0
        messages, error = await collect(
            stub.Generate(sgl_generate("after"), metadata=model_md("m"), timeout=10)
        )
    assert error is None and len(messages) == 5
    assert (await worker_state(gw)).breaker_state == admin_pb.BREAKER_STATE_CLOSED


async def test_a_queued_call_whose_client_cancels_never_reaches_a_worker(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """A queued call cancelled by its client leaves the queue at once; when the slot
    frees, nothing is sent for it: the worker goes idle and the record says no attempt."""
    worker = sim("--model", "m", "--headers-first")  # a held call shows by its headers
    settings = {"models": {"m": {"max_inflight": 1}}, "flow": {}}
    gw = flow_gateway(gateway, tmp_path, [worker], settings)
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = await hold(stub)
        gone = stub.Generate(sgl_generate("gone"), metadata=model_md("m"), timeout=20)
        await until_waiting(gw, 1)
        gone.cancel()
        await until_waiting(gw, 0)
        assert_never_placed(one_event(gw, "gone"), "CANCELLED")

        async def counted() -> bool:
            return await flow_outcome(gw, "standard", "cancelled") == 1

        await until(counted, what="the cancelled outcome counted")
        assert (await worker_state(gw)).inflight == 1
        assert await running_on_sim(worker.address) == 1

        held.cancel()  # the slot frees: the room has nobody left to serve

        async def settled() -> bool:
            return bool((await worker_state(gw)).inflight == 0)

        await until(settled, what="nothing in flight")
        assert await wait_idle(worker.address) == 0
    log = gw.log_path
    generated = wait_for_events(log, 2, rpc="Generate")
    assert [e["request_id"] for e in generated] == ["gone", "held"]
    assert await flow_outcome(gw, "standard", "admitted") == 1  # held; never "gone"


async def test_a_tenant_past_its_requests_per_minute_is_rate_limited_with_retry_info(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """A tenant allowed two requests a minute: its third is RATE_LIMITED (429) with
    RetryInfo saying when its budget allows it (some 30 s: the bucket refills one
    request every 30 s), before it queues or reaches a worker; another tenant is served."""
    worker = sim("--model", "m", "--headers-first")  # a held call shows by its headers
    settings = {
        "flow": {"trust_tenant_header": True},
        "tenants": {"alice": {"requests_per_minute": 2}},
    }
    gw = flow_gateway(gateway, tmp_path, [worker], settings)
    await wait_health(gw.address, "m")
    alice = model_md("m", ("x-tenant-id", "alice"))
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(2):
            messages, error = await collect(
                stub.Generate(sgl_generate(f"ok{i}"), metadata=alice, timeout=10)
            )
            assert error is None and len(messages) == 5
        _, error = await collect(stub.Generate(sgl_generate("third"), metadata=alice, timeout=10))
        bob = model_md("m", ("x-tenant-id", "bob"))
        messages, bob_error = await collect(
            stub.Generate(sgl_generate("bob"), metadata=bob, timeout=10)
        )
    assert bob_error is None and len(messages) == 5
    assert error is not None
    retry_ms = int(trailers(error)["grpc-retry-pushback-ms"])
    assert 20_000 < retry_ms <= 30_000  # 30 s after the first call, less what has passed
    assert_verdict(
        error,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "RATE_LIMITED",
        "Tenant 'alice' is over its rate limit (requests_per_minute 2); "
        f"its budget allows this call in {retry_ms} ms",
        {
            "model": "m",
            "leg": "",
            "httpStatus": "429",
            "code": "rate_limited",
            "tenant": "alice",
            "limit": "requests_per_minute",
        },
        retry_s=math.ceil(retry_ms / 1000),
        pushback_ms=retry_ms,
        retry_ms_exact=True,
    )
    assert_never_placed(one_event(gw, "third"), "RESOURCE_EXHAUSTED")
