"""Flow control in process: with a `flow:` section, a call that finds every worker at its
`max_inflight` waits in its model's queue and is served when a slot frees, by class;
each way out of the queue has its own answer (QUEUE_FULL, QUEUE_TIMEOUT, the client's
deadline or cancel), and nothing that left the queue unserved reached a worker."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.admin.client import run_queues
from gateway.admin.text import format_queues
from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.app.server import Gateway
from gateway.observability.record import CallRecord
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.helpers import assert_verdict
from tests.support.inproc import client, gateway, idle, recorded, sim
from tests.support.waits import until

HOLD = ("x-sim-ttft-ms", "30000")  # a call that holds its worker's one slot


@asynccontextmanager
async def one_slot(
    tenants: dict[str, Any] | None = None, **settings: Any
) -> AsyncIterator[tuple[Gateway, Any, list[CallRecord]]]:
    """A gateway in front of one worker that takes one call at a time (`flow` settings,
    `tenants`); the records of the calls that ended."""
    overrides: dict[str, Any] = {
        "models": {"m": {"max_inflight": 1}},
        "flow": settings,
        "tenants": tenants or {},
    }
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), **overrides) as gw,
        client(gw) as ch,
    ):
        yield gw, sgl_grpc.SglangSchedulerStub(ch), recorded(gw)


def waiting(gw: Gateway) -> int:
    assert gw.parts.rooms is not None
    return gw.parts.rooms.waiting("m")


async def test_a_call_waits_for_the_busy_worker_and_is_served_when_it_frees() -> None:
    async with one_slot() as (gw, stub, records):
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        await until(lambda: gw.parts.fleet.registry.pool("m", *_regular())[0].inflight == 1)
        queued = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("queued"), metadata=model_md("m")))
        )
        await until(lambda: waiting(gw) == 1)
        sample = gw.parts.metrics.prometheus.get_sample_value
        assert sample("gateway_flow_queue_depth", {"model": "m", "class": "standard"}) == 1
        queue_bytes = sample("gateway_flow_queue_bytes", {"model": "m"})
        assert queue_bytes is not None and queue_bytes > 0
        held.cancel()
        messages, error = await queued
        assert error is None and len(messages) == 5
        await idle(gw)
        served = next(r for r in records if r.request_id == "queued")
        assert (served.code, served.priority, served.tenant) == ("OK", "standard", "default")
        assert served.queued_s is not None and served.queued_s > 0
        assert waiting(gw) == 0
        outcomes = {"class": "standard", "outcome": "admitted"}
        assert sample("gateway_flow_outcomes_total", outcomes) == 2  # held and queued
        assert sample("gateway_flow_wait_seconds_count", {"class": "standard"}) == 2
        assert (
            sample("gateway_flow_queue_depth", {"model": "m", "class": "standard"}) == 0
        )  # not absent


async def test_a_full_queue_is_queue_full_with_retry_hints() -> None:
    async with one_slot(queue={"max_requests": 1}) as (gw, stub, _):
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        await until(lambda: gw.parts.fleet.registry.pool("m", *_regular())[0].inflight == 1)
        queued = stub.Generate(sgl_generate("queued"), metadata=model_md("m"))
        await until(lambda: waiting(gw) == 1)
        _, error = await collect(stub.Generate(sgl_generate("third"), metadata=model_md("m")))
        assert error is not None
        assert_verdict(
            error,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QUEUE_FULL",
            "Every worker for model 'm' is busy and its queue is full "
            "(1 waiting, flow.queue.max_requests 1)",
            {"model": "m", "leg": "", "httpStatus": "429", "code": "queue_full"},
            retry_s=1,
            pushback_ms=1000,
        )
        held.cancel()
        queued.cancel()
        await idle(gw)


async def test_a_call_waiting_past_its_class_ttl_is_queue_timeout() -> None:
    classes = [{"name": "standard", "ttl_s": 0.2}]
    async with one_slot(classes=classes) as (gw, stub, records):
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        await until(lambda: gw.parts.fleet.registry.pool("m", *_regular())[0].inflight == 1)
        _, error = await collect(stub.Generate(sgl_generate("late"), metadata=model_md("m")))
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details().startswith(
            "Waited 0.2 s for a worker for model 'm' (class standard)"
        )
        assert_verdict(
            error,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QUEUE_TIMEOUT",
            error.details(),
            {
                "model": "m",
                "leg": "",
                "class": "standard",
                "httpStatus": "429",
                "code": "queue_timeout",
            },
            retry_s=1,
            pushback_ms=1000,
        )
        late = next(r for r in records if r.request_id == "late")
        assert late.attempts == 0  # never placed: no worker saw it
        held.cancel()
        await idle(gw)
        assert waiting(gw) == 0


async def test_a_cancel_or_deadline_while_queued_reaches_no_worker_and_blames_none() -> None:
    async with one_slot() as (gw, stub, records):
        busy = gw.parts.fleet.registry.pool("m", *_regular())[0]
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        await until(lambda: busy.inflight == 1)
        cancelled = stub.Generate(sgl_generate("gone"), metadata=model_md("m"))
        await until(lambda: waiting(gw) == 1)
        cancelled.cancel()
        await until(lambda: waiting(gw) == 0)
        _, error = await collect(
            stub.Generate(sgl_generate("deadline"), metadata=model_md("m"), timeout=0.3)
        )
        assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: {r.request_id for r in records} >= {"gone", "deadline"})
        for record in records:
            assert record.attempts == 0 and record.legs == {}  # no worker was called
        by_id = {r.request_id: r for r in records}
        # Their time in the queue counts, though they left it unserved.
        assert (by_id["deadline"].queued_s or 0) >= 0.25
        assert (by_id["gone"].queued_s or 0) > 0
        sample = gw.parts.metrics.prometheus.get_sample_value
        waited = {"class": "standard"}
        assert sample("gateway_flow_wait_seconds_count", waited) == 2
        for outcome in ("cancelled", "deadline"):
            labels = {"class": "standard", "outcome": outcome}
            assert sample("gateway_flow_outcomes_total", labels) == 1
        assert busy.inflight == 1 and waiting(gw) == 0
        assert busy.outlier.failures == 0
        held.cancel()
        await idle(gw)


async def test_a_higher_class_is_served_first() -> None:
    async with one_slot() as (gw, stub, records):
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        busy = gw.parts.fleet.registry.pool("m", *_regular())[0]
        await until(lambda: busy.inflight == 1)
        batch = asyncio.ensure_future(
            collect(
                stub.Generate(
                    sgl_generate("batch"), metadata=model_md("m", ("x-priority", "batch"))
                )
            )
        )
        await until(lambda: waiting(gw) == 1)
        urgent = asyncio.ensure_future(
            collect(
                stub.Generate(
                    sgl_generate("urgent"), metadata=model_md("m", ("x-priority", "interactive"))
                )
            )
        )
        await until(lambda: waiting(gw) == 2)
        held.cancel()
        await urgent
        await batch
        order = [r.request_id for r in records if r.request_id in ("urgent", "batch")]
        assert order == ["urgent", "batch"]
        classes = {r.request_id: (r.priority, r.lowered) for r in records}
        assert classes["urgent"] == ("interactive", False)
        assert classes["batch"] == ("batch", False)
        await idle(gw)


async def test_a_tenant_asking_above_its_max_class_is_lowered_and_the_record_says_so() -> None:
    tenants = {"default": {"max_class": "standard"}}
    async with one_slot(tenants) as (_, stub, records):
        asked = model_md("m", ("x-priority", "interactive"))
        _, error = await collect(stub.Generate(sgl_generate("pushy"), metadata=asked))
        assert error is None
        await until(lambda: any(r.request_id == "pushy" for r in records))
        pushy = next(r for r in records if r.request_id == "pushy")
        assert (pushy.tenant, pushy.priority, pushy.lowered) == ("default", "standard", True)
        assert pushy.log_fields()["lowered"] is True


async def test_a_model_without_any_ready_worker_is_refused_at_once_not_queued() -> None:
    async with one_slot() as (gw, stub, _):
        for w in gw.parts.fleet.registry:
            gw.parts.fleet.set_in_service(w, False, "test: out of service")
        _, error = await collect(stub.Generate(sgl_generate("r"), metadata=model_md("m")))
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        assert waiting(gw) == 0


def _regular() -> tuple[Any, Any]:
    from gateway.core.roles import Role, Runtime

    return Runtime.SGLANG, Role.REGULAR


async def test_a_tenant_at_its_max_inflight_waits_while_others_go_on() -> None:
    tenants = {"alice": {"max_inflight": 1}}
    async with (
        sim("--model", "m") as w,
        gateway(
            w.url(model="m", runtime="sglang"),
            flow={"trust_tenant_header": True},
            tenants=tenants,
        ) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)

        def as_(tenant: str, *extra: tuple[str, str]) -> Any:
            return model_md("m", ("x-tenant-id", tenant), *extra)

        held = stub.Generate(sgl_generate("alice-1"), metadata=as_("alice", HOLD))
        busy = gw.parts.fleet.registry.pool("m", *_regular())[0]
        await until(lambda: busy.inflight == 1)
        second = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("alice-2"), metadata=as_("alice")))
        )
        await until(lambda: waiting(gw) == 1)
        messages, error = await collect(stub.Generate(sgl_generate("bob-1"), metadata=as_("bob")))
        assert error is None and len(messages) == 5  # bob is not held up by alice's limit
        assert waiting(gw) == 1 and not second.done()
        held.cancel()
        messages, error = await second
        assert error is None and len(messages) == 5
        await idle(gw)
        assert gw.parts.rooms is not None and gw.parts.rooms._inflight == {}


async def test_calls_still_queued_when_the_drain_ends_are_shutting_down_with_retry_hints() -> None:
    drain: dict[str, Any] = {"drain.grace_s": 0.6, "drain.delay_s": 0.0}
    async with (
        sim("--model", "m") as w,
        gateway(
            w.url(model="m", runtime="sglang"),
            models={"m": {"max_inflight": 1}},
            flow={},
            **drain,
        ) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        busy = gw.parts.fleet.registry.pool("m", *_regular())[0]
        await until(lambda: busy.inflight == 1)
        queued = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("queued"), metadata=model_md("m")))
        )
        await until(lambda: waiting(gw) == 1)
        draining = asyncio.ensure_future(gw.drain_and_stop(delay=False))
        _, error = await queued
        assert error is not None
        assert_verdict(
            error,
            grpc.StatusCode.UNAVAILABLE,
            "SHUTTING_DOWN",
            "The gateway is shutting down; this call for model 'm' was still waiting for a worker",
            {"model": "m", "leg": "", "httpStatus": "503", "code": "shutting_down"},
            retry_s=1,
            pushback_ms=1000,
        )
        held.cancel()
        await draining
        sample = gw.parts.metrics.prometheus.get_sample_value
        outcome = {"class": "standard", "outcome": "shutting_down"}
        assert sample("gateway_flow_outcomes_total", outcome) == 1


async def test_the_admin_api_and_cli_show_what_waits_by_model_class_and_tenant(
    capsys: Any,
) -> None:
    async with one_slot() as (gw, stub, _):
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        busy = gw.parts.fleet.registry.pool("m", *_regular())[0]
        await until(lambda: busy.inflight == 1)
        waits = [
            stub.Generate(sgl_generate(f"w{i}"), metadata=model_md("m", ("x-priority", klass)))
            for i, klass in enumerate(("batch", "batch", "interactive"))
        ]
        await until(lambda: waiting(gw) == 3)
        admin = f"127.0.0.1:{gw.admin_port}"
        async with aio.insecure_channel(admin) as ch:
            listed = await admin_pb2_grpc.AdminServiceStub(ch).ListQueues(
                admin_pb.ListQueuesRequest(), timeout=5
            )
        assert listed.enabled
        assert [(q.model, q.priority, q.tenant, q.waiting) for q in listed.queues] == [
            ("m", "batch", "default", 2),
            ("m", "interactive", "default", 1),
        ]
        args = argparse.Namespace(admin=admin, token=None, json=False)
        capsys.readouterr()  # the gateway's own log lines so far
        assert await asyncio.to_thread(run_queues, args) == 0
        assert capsys.readouterr().out.splitlines()[-3:] == [
            "MODEL  CLASS        TENANT   WAITING",
            "m      batch        default  2",
            "m      interactive  default  1",
        ]
        for call in [held, *waits]:
            call.cancel()
        await idle(gw)
    assert format_queues(admin_pb.ListQueuesResponse(enabled=True)) == "no calls waiting"
    assert format_queues(admin_pb.ListQueuesResponse()) == (
        "flow control is off (no flow: section): calls are refused, never queued"
    )


async def test_a_worker_without_a_fresh_load_report_waits_out_the_load_limits() -> None:
    """With flow control and a load limit, a stale report counts as saturated: the call
    waits, and the next load poll (not a released slot: none is in flight) serves it."""
    # Stale after three intervals; KV-event load records off (they refresh it too).
    loads: dict[str, Any] = {"loads.interval_s": 0.5, "kv.events": False}
    async with (
        sim("--model", "m") as w,
        gateway(
            w.url(model="m", runtime="sglang"),
            models={"m": {"max_waiting": 5}},
            flow={},
            **loads,
        ) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        busy = gw.parts.fleet.registry.pool("m", *_regular())[0]
        await until(lambda: busy.load is not None)
        assert busy.load is not None
        # Just after a poll, so the next one is an interval away (not between these lines).
        polled = busy.load.at
        await until(lambda: busy.load is not None and busy.load.at != polled)
        assert busy.load is not None
        busy.reported(dataclasses.replace(busy.load, at=busy.load.at - 10))  # stale now
        stub = sgl_grpc.SglangSchedulerStub(ch)
        messages, error = await collect(stub.Generate(sgl_generate("r"), metadata=model_md("m")))
        assert error is None and len(messages) == 5
        await until(lambda: bool(records))
        assert records[-1].queued_s is not None and records[-1].queued_s > 0.01
        await idle(gw)


async def test_a_call_with_several_choices_waits_as_one_call() -> None:
    async with one_slot() as (gw, stub, records):
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD))
        await until(lambda: gw.parts.fleet.registry.pool("m", *_regular())[0].inflight == 1)
        queued = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("two", n=2), metadata=model_md("m")))
        )
        await until(lambda: waiting(gw) == 1)
        held.cancel()
        messages, error = await queued
        assert error is None and len(messages) == 10  # 4 chunks + 1 complete per choice
        await idle(gw)
        served = next(r for r in records if r.request_id == "two")
        assert served.code == "OK" and served.queued_s is not None and served.queued_s > 0
