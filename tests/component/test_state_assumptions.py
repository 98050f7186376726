"""What cache-aware placement learns, shared through a real store (redis-server on
127.0.0.1): the gateways agree on one secret for their block keys; a prompt placed by one
gateway is known cached there by the others within a flush; a gateway skips its own
messages and workers it does not know; junk is refused."""

from __future__ import annotations

import struct
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.config import StateConfig
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix, seed_tag
from gateway.state.assumptions import SharedAssumptions
from gateway.state.store import Store
from gateway_sim.redis_server import RedisServer
from tests.support.waits import until

WORKERS = {"10.0.0.1:30000", "10.0.0.2:30000"}
PROMPT = list(range(1, 161))  # ten blocks of 16


class Gateway:
    def __init__(self, url: str) -> None:
        self.store = Store(StateConfig(url=url, retry_s=0.1))
        self.index = KvIndex(block_size=16)
        self.shared = SharedAssumptions(self.index, self.store, WORKERS.__contains__)
        self.store.spawn(self.shared.publish(), "publish")  # as the server does
        self.store.spawn(self.shared.follow(), "follow")

    def matched(self, worker: str) -> int:
        prefix = Prefix(PROMPT)
        prefix.compute([16])
        return self.index.matched_tokens(prefix, [worker], time.monotonic()).get((worker, 0), 0)

    async def close(self) -> None:
        await self.store.close()


@pytest.fixture
async def gateways(redis_server: RedisServer) -> AsyncIterator[list[Gateway]]:
    made = [Gateway(redis_server.url) for _ in range(3)]
    for gateway in made:
        assert await gateway.shared.agree()  # one secret for the block keys, the first's
    yield made
    for gateway in made:
        await gateway.close()


async def subscribed(redis_server: RedisServer, count: int) -> bool:
    raw = Redis.from_url(redis_server.url)
    try:
        numbers = await raw.pubsub_numsub("gateway:kv:assumed")
    finally:
        await raw.aclose()
    return bool(numbers) and int(numbers[0][1]) >= count


async def test_a_placement_on_one_gateway_is_known_to_the_others(
    redis_server: RedisServer, gateways: list[Gateway]
) -> None:
    await until(lambda: subscribed(redis_server, 3), what="every gateway follows")
    placed = Prefix(PROMPT)
    placed.compute([16])
    gateways[0].index.assume(("10.0.0.1:30000", 0), placed, time.monotonic())
    gateways[0].index.assume(("10.9.9.9:1", 0), placed, time.monotonic())  # unknown elsewhere
    await until(
        lambda: all(g.matched("10.0.0.1:30000") == len(PROMPT) for g in gateways),
        what="every gateway knows where the prompt went",
    )
    assert all(g.matched("10.0.0.2:30000") == 0 for g in gateways)
    assert all(g.index.size("10.9.9.9:1") == 0 for g in gateways[1:])  # not applied


async def test_the_gateways_agree_on_one_secret_for_their_keys(
    redis_server: RedisServer, gateways: list[Gateway]
) -> None:
    raw = Redis.from_url(redis_server.url)
    try:
        secret = await raw.get("gateway:kv:seed")
        assert isinstance(secret, bytes) and len(secret) == 32
        await raw.set("gateway:kv:seed", b"short")  # junk: refused, the process keeps its own
        assert not await gateways[0].shared.agree()
        assert gateways[0].store.errors[("kv_seed", "invalid")] == 1
    finally:
        await raw.aclose()


async def test_junk_on_the_channel_is_refused(
    redis_server: RedisServer, gateways: list[Gateway]
) -> None:
    await until(lambda: subscribed(redis_server, 3), what="every gateway follows")
    raw = Redis.from_url(redis_server.url)
    try:
        truncated = b"\x00" * 16 + seed_tag() + struct.pack("!I", 5) + b"x" * 10
        for junk in (b"short", truncated, b"y" * 200_000):
            await raw.publish("gateway:kv:assumed", junk)
    finally:
        await raw.aclose()
    store = gateways[1].store
    await until(lambda: store.errors[("kv_share", "invalid")] == 3, what="all three refused")
    assert gateways[1].matched("10.0.0.1:30000") == 0
