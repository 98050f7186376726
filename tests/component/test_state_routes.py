"""Model aliases' routes through a real store (redis-server on 127.0.0.1): a route set on
one replica is followed by the others, survives their restart, waits out a store that is
away, and junk in the store changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.config import StateConfig
from gateway.placement.routes import RouteTable
from gateway.state.routes import RouteWriter, parse_route
from gateway.state.store import Store
from gateway_sim.redis_server import RedisServer
from tests.support.waits import until

FILE_ROUTE = (("v2", 90), ("v3", 10))
NAMED = frozenset({"v2", "v3"})


class Replica:
    """One serving process's routes: its table from the file, following the store."""

    def __init__(self, url: str) -> None:
        self.store = Store(StateConfig(url=url, retry_s=0.1, resync_s=0.2))
        self.table = RouteTable({"chat": FILE_ROUTE}, NAMED)
        self.writer = RouteWriter(self.table, self.store)
        self.store.spawn(self.writer.follow(), "routes_follow")  # as the server does

    async def close(self) -> None:
        await self.store.close()


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[list[Replica]]:
    made = [Replica(redis_server.url) for _ in range(3)]
    yield made
    for replica in made:
        await replica.close()


async def test_a_route_set_on_one_replica_is_followed_by_the_others(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    await replicas[0].writer.set("chat", (("v3", 100),))
    assert replicas[0].table.route("chat") == (("v3", 100),)  # here at once
    await until(
        lambda: all(r.table.route("chat") == (("v3", 100),) for r in replicas),
        what="every replica follows",
    )
    restarted = Replica(redis_server.url)  # a replica started afterwards: the store wins
    try:
        await until(lambda: restarted.table.route("chat") == (("v3", 100),), what="restart")
    finally:
        await restarted.close()


async def test_a_route_set_while_the_store_is_away_is_written_once_it_is_back(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    redis_server.stop()
    await replicas[0].writer.set("chat", (("v2", 50), ("v3", 50)))
    assert replicas[0].table.route("chat") == (("v2", 50), ("v3", 50))
    assert replicas[1].table.route("chat") == FILE_ROUTE
    redis_server.start()  # back, empty
    await until(
        lambda: all(r.table.route("chat") == (("v2", 50), ("v3", 50)) for r in replicas),
        what="the change made meanwhile reaches every replica",
    )
    assert replicas[0].store.up


async def test_junk_in_the_store_changes_no_route(
    redis_server: RedisServer, replicas: list[Replica]
) -> None:
    raw = Redis.from_url(redis_server.url)
    try:
        await raw.hset(
            "gateway:routes",
            mapping={"chat": b"\xff not json", "other": b'[["v2", 1]]', "x" * 300: b"[]"},
        )
        await raw.publish("gateway:routes:changed", "chat")
        store = replicas[1].store
        await until(lambda: store.errors[("routes_read", "invalid")] >= 3, what="refused")
        assert replicas[1].table.route("chat") == FILE_ROUTE
        assert replicas[1].table.route("other") is None  # no alias here
        refused = store.errors[("routes_read", "invalid")]
        await replicas[1].writer.read()
        assert store.errors[("routes_read", "invalid")] == refused  # logged once a value
        await raw.hset("gateway:routes", "chat", b'[["v3", 1], ["nowhere", 1]]')
        await replicas[1].writer.read()  # a target the config does not allow
        assert replicas[1].table.route("chat") == FILE_ROUTE
    finally:
        await raw.aclose()


def test_only_routes_parse() -> None:
    assert parse_route(b'[["a", 1], ["b", 0]]', 1000) == (("a", 1), ("b", 0))
    for junk in (b"[]", b'{"a": 1}', b'[["a", true]]', b'[["a", 1.5]]', b'[["a", -1]]', b"[1]"):
        assert parse_route(junk, 1000) is None
    assert parse_route(b'[["a", 1]]' + b" " * 100, 50) is None
