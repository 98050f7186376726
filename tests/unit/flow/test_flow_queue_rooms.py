"""A model's waiting room lives only while calls wait in it: once they all left, however
they left, nothing of them stays (no room, no queue, no tenant count)."""

from __future__ import annotations

import asyncio
import gc
from typing import cast

from gateway.config import FlowClassConfig, FlowConfig, TenantConfig
from gateway.core import verdicts
from gateway.core.verdicts import Reason, Verdict
from gateway.flow.queue import Waiter
from gateway.placement.decision import Decision
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.upstream import Upstreams
from gateway.proxy.waiting import Ticket, WaitingRooms


def overloaded(tried: object = ()) -> Decision | Verdict:
    return verdicts.workers_overloaded("m", "", 0, 1000)


async def queued(
    rooms: WaitingRooms, tenants: int, calls: int, klass: int = 1
) -> list[asyncio.Task[ReservedPlacement | Verdict]]:
    """`calls` calls of `tenants` tenants waiting for model m (every worker busy)."""

    async def admit(tenant: str) -> ReservedPlacement | Verdict:
        return await rooms.admit("m", tenant, klass, 100.0, 10, overloaded)

    tasks = [asyncio.ensure_future(admit(f"t{i % tenants}")) for i in range(calls)]
    for _ in range(100):  # each admit queues at its first step; this is a safety net
        if rooms.waiting("m") == calls:
            break
        await asyncio.sleep(0)
    assert rooms.waiting("m") == calls
    return tasks


def rooms_of(tenant: TenantConfig, settings: FlowConfig | None = None) -> WaitingRooms:
    # No call is ever placed here, so nothing is reserved: no upstreams are needed.
    flow = settings or FlowConfig()
    return WaitingRooms(flow, lambda name: tenant, cast(Upstreams, None), 1000)


async def test_a_room_whose_calls_all_left_while_a_serve_pass_was_due_goes() -> None:
    rooms = rooms_of(TenantConfig(max_inflight=4))
    tasks = await queued(rooms, tenants=50, calls=2000)
    for task in tasks:  # every client goes...
        task.cancel()
    rooms.kick("m")  # ...while a serve pass is due (capacity may have come free): it runs last
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(100):
        if not rooms._rooms:
            break
        await asyncio.sleep(0)  # the serve pass runs, finds none
    assert rooms._rooms == {} and rooms._inflight == {}
    del tasks, task  # (a task keeps its coroutine)
    assert await alive(Waiter) == await alive(Ticket) == 0


async def alive(kind: type) -> int:
    """`kind` objects still alive, once the loop has run what the calls' ends scheduled
    (a cancelled call's exception, and so its frame, lives until then)."""
    for _ in range(20):
        gc.collect()
        left = sum(isinstance(thing, kind) for thing in gc.get_objects())
        if not left:
            break
        await asyncio.sleep(0)
    return left


async def test_a_room_whose_calls_timed_out_goes() -> None:
    settings = FlowConfig(classes=(FlowClassConfig("only", ttl_s=0.05),), default_class="only")
    rooms = rooms_of(TenantConfig(), settings)
    tasks = await queued(rooms, tenants=50, calls=500, klass=0)
    answers = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)  # a safety net
    assert {cast(Verdict, a).reason for a in answers} == {Reason.QUEUE_TIMEOUT}
    assert rooms._rooms == {} and rooms._inflight == {}
    del tasks
    assert await alive(Waiter) == await alive(Ticket) == 0
