"""Per-tenant flow outcomes in process: calls of two tenants (named by the tenant header
behind a trusted proxy) through a gateway whose one worker takes one call at a time,
and the exact `gateway_flow_tenant_outcomes_total` series they leave: a tenant is named
from its second call on, its first counted as `other`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.app.server import Gateway
from gateway.core.roles import Role, Runtime
from gateway.flow.metrics import FLOW_OUTCOMES
from gateway.observability.record import CallRecord
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.inproc import client, gateway, idle, recorded, sim
from tests.support.waits import until

HOLD = ("x-sim-ttft-ms", "30000")  # a call that holds its worker's one slot
SERIES = "gateway_flow_tenant_outcomes_total"


@asynccontextmanager
async def one_slot() -> AsyncIterator[tuple[Gateway, Any, list[CallRecord]]]:
    """One worker taking one call at a time, a queue of one, the tenant header trusted;
    the records of the calls that ended, in the order the metrics saw them."""
    overrides: dict[str, Any] = {
        "models": {"m": {"max_inflight": 1}},
        "flow": {"queue": {"max_requests": 1}, "trust_tenant_header": True},
    }
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), **overrides) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        yield gw, sgl_grpc.SglangSchedulerStub(ch), records


def md(tenant: str, *extra: tuple[str, str]) -> tuple[tuple[str, str | bytes], ...]:
    return model_md("m", ("x-tenant-id", tenant), *extra)


async def test_outcomes_are_counted_per_tenant_with_first_calls_as_other() -> None:
    async with one_slot() as (gw, stub, records):
        busy = gw.parts.fleet.registry.pool("m", Runtime.SGLANG, Role.REGULAR)[0]
        rooms = gw.parts.rooms
        assert rooms is not None

        async def ended(*ids: str) -> None:  # pins each tenant's order of calls seen
            await until(lambda: {r.request_id for r in records} >= set(ids))

        held = stub.Generate(sgl_generate("held"), metadata=md("alice", HOLD))
        await until(lambda: busy.inflight == 1)
        queued = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("q"), metadata=md("bob")))
        )
        await until(lambda: rooms.waiting("m") == 1)
        # bob holds the whole queue: his next call finds no room (QUEUE_FULL).
        _, error = await collect(stub.Generate(sgl_generate("full"), metadata=md("bob")))
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        await ended("full")  # bob's first call: other
        held.cancel()
        messages, error = await queued
        assert error is None and len(messages) == 5
        await ended("held", "q")  # alice's first (admitted, then cancelled), bob's second
        await idle(gw)
        held = stub.Generate(sgl_generate("held2"), metadata=md("alice", HOLD))
        await until(lambda: busy.inflight == 1)
        late = stub.Generate(sgl_generate("late"), metadata=md("alice"), timeout=0.3)
        _, error = await collect(late)
        assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await ended("late")  # alice's second call: alice
        held.cancel()
        await ended("held2")
        await idle(gw)

        # A tenant's label depends on its own calls only (20 names, 2 tenants).
        seen = {t: [r.request_id for r in records if r.tenant == t] for t in ("alice", "bob")}
        assert seen == {"alice": ["held", "late", "held2"], "bob": ["full", "q"]}
        sample = gw.parts.metrics.prometheus.get_sample_value
        expected = {
            ("other", "queue_full"): 1.0,
            ("other", "admitted"): 1.0,
            ("bob", "admitted"): 1.0,
            ("alice", "deadline"): 1.0,
            ("alice", "admitted"): 1.0,
        }
        for tenant in ("alice", "bob", "other"):
            for outcome in FLOW_OUTCOMES:
                labels = {"tenant": tenant, "outcome": outcome}
                assert sample(SERIES, labels) == expected.get((tenant, outcome)), labels
        by_class = {"class": "standard", "outcome": "admitted"}
        assert sample("gateway_flow_outcomes_total", by_class) == 3  # held, q, held2
