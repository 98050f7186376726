"""Flow control through real processes (issue 17), at the edges of a gateway's life and
load: a SIGTERM drain serves the queued calls while it lasts, then answers SHUTTING_DOWN
(code, ErrorInfo, x-http-status); and under a mixed saturated load no worker ever runs
more than its `max_inflight` by its own count (`x-sim-running`), and every call gets an
answer.

Every wait is on observable state (the call's response headers, ListQueues, ListWorkers,
the request log), bounded."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from gateway_sim.client import (
    channel,
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
    trailers,
    wait_health,
    wait_idle,
)
from gateway_sim.launch import Child, start_many
from tests.support.flow_e2e import (
    HOLD,
    assert_never_placed,
    flow_gateway,
    hold,
    one_event,
    until_waiting,
    waiting,
)
from tests.support.helpers import assert_verdict, rich_status, wait_for_events
from tests.support.launch import Launcher
from tests.support.serial import run_alone
from tests.support.waits import until

SHUTDOWN_META = {"model": "m", "leg": "", "httpStatus": "503", "code": "shutting_down"}
SHUTDOWN_MESSAGE = (
    "The gateway is shutting down; this call for model 'm' was still waiting for a worker"
)


# Refusals a saturated gateway may answer with flow control, and nothing else.
FLOW_REFUSALS = {"QUEUE_FULL", "QUEUE_TIMEOUT", "RATE_LIMITED"}


def log_events(gw: Child) -> list[dict[str, Any]]:
    """Every JSON line of the gateway's log (not only the request events)."""
    events = []
    for line in gw.log_path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


async def test_sigterm_serves_queued_calls_while_the_drain_lasts_then_shutting_down(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """SIGTERM with three calls queued behind a busy slot: the first two keep their place
    and are served during the drain (one ends OK, the other runs past the grace and is
    cut as any such stream is); the third, still queued a quarter second before the grace
    ends, is UNAVAILABLE SHUTTING_DOWN with RetryInfo; the gateway exits 0."""
    grace = 2.5  # ample time to free the slot before the queue is answered
    worker = sim("--model", "m", "--headers-first")  # a held call shows by its headers
    settings = {"models": {"m": {"max_inflight": 1}}, "flow": {}}
    gw = flow_gateway(gateway, tmp_path, [worker], settings, "--shutdown-grace", str(grace))
    await wait_health(gw.address, "m")
    run_alone()  # the grace's quarter-second margin is a timing window
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = await hold(stub)
        calls = []
        for i, extra in enumerate(((("x-sim-ttft-ms", "100"),), (HOLD,), ())):
            call = stub.Generate(sgl_generate(f"q{i}"), metadata=model_md("m", *extra), timeout=20)
            calls.append(call)
            await until_waiting(gw, i + 1)  # in this order in the queue
        ended: list[float] = [0.0] * len(calls)  # when each call's answer came

        async def read(i: int) -> tuple[list[Any], aio.AioRpcError | None]:
            got = await collect(calls[i])
            ended[i] = time.monotonic()
            return got

        readers = [asyncio.ensure_future(read(i)) for i in range(len(calls))]
        terminated = time.monotonic()
        gw.process.send_signal(signal.SIGTERM)

        async def stopping() -> bool:
            return any(e.get("event") == "stopping" for e in log_events(gw))

        await until(stopping, what="the drain started")
        assert all(not r.done() for r in readers)
        held.cancel()  # a slot frees during the drain

        (ok, ok_error), (_, cut_error), (refused, refused_error) = await asyncio.wait_for(
            asyncio.gather(*readers), timeout=grace + 5
        )
        cut_headers = dict(await calls[1].initial_metadata())
        code = await asyncio.to_thread(gw.process.wait, 10)
    assert ok_error is None and len(ok) == 5  # served in the drain
    assert cut_headers["x-sim-worker"]  # reached the worker in the drain
    assert cut_error is not None and cut_error.code() is grpc.StatusCode.UNAVAILABLE, cut_error
    assert refused == [] and refused_error is not None
    assert_verdict(
        refused_error,
        grpc.StatusCode.UNAVAILABLE,
        "SHUTTING_DOWN",
        SHUTDOWN_MESSAGE,
        SHUTDOWN_META,
        retry_s=1,
        pushback_ms=1000,
    )
    # Answered a quarter second before the grace ends (+- the signal's delivery), before
    # the stream still running is cut at its end.
    refused_at, cut_at = ended[2] - terminated, ended[1] - terminated
    assert grace - 0.3 <= refused_at <= grace + 1.0, refused_at
    assert refused_at < cut_at, (refused_at, cut_at)
    assert code == 0
    assert_never_placed(one_event(gw, "q2"), "UNAVAILABLE")
    assert one_event(gw, "q0")["code"] == "OK"


# --------------------------------------------------------------------------- saturated

SLOTS = 2  # max_inflight of each worker
WAVES, WAVE_SIZE = 6, 10
CLASSES = ("interactive", "standard", "batch")
TENANTS = ("alice", "bob", "carol", "dave")
DAVE_PER_MINUTE = 3  # dave's rate limit: most of its calls are RATE_LIMITED


async def test_a_saturated_mixed_load_never_exceeds_max_inflight_and_loses_no_call(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """Waves of calls of every class from four tenants (one rate limited), well over what
    two workers of two slots and a queue of sixteen hold: by the workers' own count
    (x-sim-running) neither ever ran more than its max_inflight; every call ended OK or
    with a flow answer (QUEUE_FULL, QUEUE_TIMEOUT, RATE_LIMITED: 429 with RetryInfo), the
    rate-limited tenant was served at most its budget, and the gateway's request log has
    each call once, with the code its client saw."""
    workers = start_many(sim, ("--model", "m", "--name", "w0"), ("--model", "m", "--name", "w1"))
    settings = {
        "models": {"m": {"max_inflight": SLOTS}},
        "flow": {
            "trust_tenant_header": True,
            "queue": {"max_requests": 16},
            "classes": [
                {"name": "interactive", "ttl_s": 5},
                {"name": "standard", "ttl_s": 0.5},
                {"name": "batch", "ttl_s": 0.3},
            ],
        },
        "tenants": {
            "alice": {"weight": 2},
            "carol": {"max_class": "standard"},
            "dave": {"requests_per_minute": DAVE_PER_MINUTE},
        },
    }
    gw = flow_gateway(gateway, tmp_path, workers, settings)
    await wait_health(gw.address, "m")
    outcomes: dict[str, str] = {}  # request id -> OK or the refusal's reason
    tenant_of: dict[str, str] = {}
    running: dict[str, int] = {}  # worker -> the most x-sim-running it reported
    counter = itertools.count()

    async def one(stub: Any) -> None:
        i = next(counter)
        request_id = f"s{i}"
        tenant = tenant_of[request_id] = TENANTS[i // 3 % len(TENANTS)]
        metadata = model_md(
            "m",
            ("x-priority", CLASSES[i % 3]),
            ("x-tenant-id", tenant),
            ("x-sim-ttft-ms", str(60 + 20 * (i % 5))),
        )
        call = stub.Generate(sgl_generate(request_id), metadata=metadata, timeout=30)
        messages, error = await collect(call)
        if error is None:
            headers = dict(await call.initial_metadata())
            name = str(headers["x-sim-worker"])
            running[name] = max(running.get(name, 0), int(headers["x-sim-running"]))
            assert len(messages) == 5
            outcomes[request_id] = "OK"
            return
        _, details = rich_status(error)
        reason = details["ErrorInfo"].reason
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, (error.code(), reason)
        assert reason in FLOW_REFUSALS, reason
        assert trailers(error)["x-http-status"] == "429"
        assert details["RetryInfo"].retry_delay.ToMilliseconds() > 0
        outcomes[request_id] = reason

    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        tasks = []
        for _ in range(WAVES):
            tasks += [asyncio.ensure_future(one(stub)) for _ in range(WAVE_SIZE)]
            await asyncio.sleep(0.15)  # pacing only: no assertion depends on it
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=20)
    total = WAVES * WAVE_SIZE
    counts = {k: list(outcomes.values()).count(k) for k in sorted(set(outcomes.values()))}
    print(f"\n[flow] {total} calls: {counts}; most running per worker {running}")
    assert len(outcomes) == total
    assert set(running) <= {"w0", "w1"} and running
    assert max(running.values()) <= SLOTS, running
    assert max(running.values()) == SLOTS  # it was saturated
    assert counts.get("OK", 0) >= 2 * SLOTS
    assert set(counts) - {"OK"}  # and over capacity: some calls were refused
    dave = [outcomes[r] for r, t in tenant_of.items() if t == "dave"]
    assert dave.count("OK") <= DAVE_PER_MINUTE < len(dave)
    events = wait_for_events(gw.log_path, total, rpc="Generate")
    logged = {str(e["request_id"]): e for e in events}
    assert len(events) == total and logged.keys() == outcomes.keys()
    for request_id, outcome in outcomes.items():
        event = logged[request_id]
        if outcome == "OK":
            assert event["code"] == "OK", event
        else:
            assert (event["code"], event["reason"]) == ("RESOURCE_EXHAUSTED", outcome), event
            assert event["attempts"] == 0, event
    for worker in workers:
        assert await wait_idle(worker.address) == 0
    assert await waiting(gw) == 0
