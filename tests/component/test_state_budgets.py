"""Tenants' budgets in a real store (redis-server on 127.0.0.1): replicas charge one
budget, a store that goes away costs no call, junk in a bucket's key is replaced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.config import StateConfig
from gateway.flow.budget import Charge, OverBudget
from gateway.state.budgets import TenantBudgets
from gateway.state.store import Store
from gateway_sim.redis_server import RedisServer

PER_MINUTE = 6


def limits(tenant: str) -> tuple[int | None, int | None]:
    return (PER_MINUTE, 600) if tenant != "free" else (None, None)


@pytest.fixture
async def stores(redis_server: RedisServer) -> AsyncIterator[list[Store]]:
    config = StateConfig(url=redis_server.url, retry_s=0.2)
    made = [Store(config) for _ in range(3)]  # three replicas
    yield made
    for store in made:
        await store.close()


async def test_three_replicas_admit_one_budget(stores: list[Store]) -> None:
    budgets = [TenantBudgets(limits, store) for store in stores]
    answers = [await budgets[i % 3].take("acme", 10) for i in range(3 * PER_MINUTE)]
    charged = [a for a in answers if isinstance(a, Charge)]
    refused = [a for a in answers if isinstance(a, OverBudget)]
    assert len(charged) == PER_MINUTE  # not three times as many
    assert all(charge.shared for charge in charged)
    assert {r.budget for r in refused} == {"requests_per_minute"}
    assert all(0 < r.wait_s <= 10.0 for r in refused)  # one request back in 10 s
    assert await budgets[0].take("free", 10) is None  # no limits: nothing charged


async def test_an_unused_reservation_goes_back(stores: list[Store]) -> None:
    budgets = TenantBudgets(lambda tenant: (None, 100), stores[0])
    first = await budgets.take("acme", 80)
    assert isinstance(first, Charge)
    assert isinstance(await budgets.take("acme", 80), OverBudget)
    budgets.settle(first, 10)  # used 10 of 80: 70 back
    other = TenantBudgets(lambda tenant: (None, 100), stores[1])
    for _ in range(100):  # the settlement is written in the background
        if isinstance(await other.take("acme", 80), Charge):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the unused tokens never came back")


async def test_a_store_away_costs_no_call_and_is_used_again_once_back(
    redis_server: RedisServer, stores: list[Store]
) -> None:
    store = stores[0]
    budgets = TenantBudgets(limits, store)
    assert isinstance(await budgets.take("acme", 1), Charge)
    redis_server.stop()
    local = await budgets.take("acme", 1)
    assert isinstance(local, Charge) and not local.shared  # this process's own bucket
    assert not store.up
    assert sum(store.errors.values()) == 1
    again = await budgets.take("acme", 1)  # within retry_s: not even tried
    assert isinstance(again, Charge) and not again.shared
    assert sum(store.errors.values()) == 1
    redis_server.start()  # back, empty, on the same port
    for _ in range(200):
        answer = await budgets.take("acme", 1)
        if isinstance(answer, Charge) and answer.shared:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the store was never used again")
    assert store.up


async def test_junk_in_a_bucket_is_replaced_and_reported(
    redis_server: RedisServer, stores: list[Store]
) -> None:
    budgets = TenantBudgets(limits, stores[0])
    assert isinstance(await budgets.take("acme", 1), Charge)
    raw = Redis.from_url(redis_server.url)
    try:
        keys = sorted(await raw.keys("gateway:budget:*"))
        assert len(keys) == 2  # requests and tokens, under the tenant's digest
        await raw.delete(keys[0])
        await raw.set(keys[0], "x" * 1000)  # another type
        await raw.hset(keys[1], mapping={"level": "nan?", "at": "yesterday"})
        answer = await budgets.take("acme", 1)
        assert isinstance(answer, Charge) and answer.shared
        assert stores[0].errors[("budget_take", "invalid")] == 1
        assert await raw.type(keys[0]) == b"hash"
    finally:
        await raw.aclose()
