"""What the workers' latency models learned, shared through a real store (redis-server
on 127.0.0.1): a gateway that starts reads its cold workers' models from another's and
predicts what that one predicts, from its first call; a warm model is kept; values that
are no model are refused and counted; a store that is away costs nothing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.config import StateConfig
from gateway.state.latency import TTL_S, SharedLatency
from gateway.state.store import Store
from gateway.upstream.latency import MIN_SEEN
from gateway.upstream.worker import Worker
from gateway_sim.client import free_port
from gateway_sim.redis_server import RedisServer
from tests.support.factories import worker_on
from tests.support.latency import taught


class Gateway:
    """A gateway's workers (their own latency models) and its share of them."""

    def __init__(self, url: str, ports: range = range(1, 4)) -> None:
        self.store = Store(StateConfig(url=url, retry_s=0.1))
        self.workers = [worker_on(port) for port in ports]
        self.shared = SharedLatency(self.store, lambda: self.workers)

    def worker(self, port: int) -> Worker:
        (found,) = (w for w in self.workers if w.spec.port == port)
        return found


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[tuple[Gateway, Gateway]]:
    made = Gateway(redis_server.url), Gateway(redis_server.url)
    yield made
    for gateway in made:
        await gateway.store.close()


async def test_a_starting_gateway_predicts_what_another_learned(
    pair: tuple[Gateway, Gateway], redis_server: RedisServer
) -> None:
    old, new = pair
    for worker in old.workers[:2]:  # the third: too few calls to predict anything
        taught(worker.latency, 40, speed=worker.spec.port)
        worker.latency.observe_pace(3, 0.02)
    taught(old.worker(3).latency, MIN_SEEN - 1)
    assert await old.shared.write() == 2
    assert await old.shared.write() == 0  # nothing learned since

    assert all(w.latency.predict(1000, 0, 2) is None for w in new.workers)
    assert await new.shared.read() == 2
    for port in (1, 2):
        theirs, ours = old.worker(port).latency, new.worker(port).latency
        assert ours.predict(1000, 500, 2) == pytest.approx(theirs.predict(1000, 500, 2))
        assert ours.predict_pace(3) == pytest.approx(theirs.predict_pace(3))
        assert ours.seen == theirs.seen
    assert new.worker(3).latency.predict(1000, 0, 2) is None
    assert await new.shared.read() == 0  # each cold worker looked for once a while
    assert await new.shared.write() == 0  # adopted as stored: nothing to write back

    taught(new.worker(1).latency, 1, seed=7)  # learned more: written again
    assert await new.shared.write() == 1
    raw = Redis.from_url(redis_server.url)
    try:
        assert 0 < await raw.ttl(new.shared.key(new.worker(1).id)) <= TTL_S
    finally:
        await raw.aclose()


async def test_a_warm_model_is_kept(pair: tuple[Gateway, Gateway]) -> None:
    old, new = pair
    taught(old.worker(1).latency, 40, speed=1.0)
    taught(new.worker(1).latency, 40, speed=0.25)
    assert await old.shared.write() == 1
    before = new.worker(1).latency.predict(1000, 0, 2)
    assert await new.shared.read() == 0
    assert new.worker(1).latency.predict(1000, 0, 2) == before


@pytest.mark.parametrize(
    "junk",
    [
        b"not json",
        b"x" * 70_000,  # past state.max_value_bytes
        b'{"worker": "h:1", "ttft": 1, "pace": 2}',
        "another",  # another worker's model under this one's key
        "nan",  # a sum that is not finite
        "shape",  # a fit of other features
        "negative",  # a diagonal below zero
    ],
)
async def test_junk_is_refused_and_counted(
    pair: tuple[Gateway, Gateway], redis_server: RedisServer, junk: bytes | str
) -> None:
    old, new = pair
    taught(old.worker(1).latency, 40)
    assert await old.shared.write() == 1
    key = old.shared.key(old.worker(1).id)
    raw = Redis.from_url(redis_server.url)
    try:
        value = await raw.get(key)
        assert value is not None
        stored = json.loads(value)
        if junk == "another":
            stored["worker"] = "h:2"
        elif junk == "nan":
            stored["ttft"]["b"][0] = float("nan")
        elif junk == "shape":
            stored["ttft"]["b"] = stored["ttft"]["b"][:3]
        elif junk == "negative":
            stored["ttft"]["a"][1][1] = -1.0
        await raw.set(key, junk if isinstance(junk, bytes) else json.dumps(stored).encode())
    finally:
        await raw.aclose()
    assert await new.shared.read() == 0
    assert new.worker(1).latency.predict(1000, 0, 2) is None
    assert new.store.errors[("latency_read", "invalid")] == 1


async def test_a_store_that_is_away_costs_nothing_but_the_warm_start() -> None:
    gateway = Gateway(f"redis://127.0.0.1:{free_port()}")
    try:
        taught(gateway.worker(1).latency, 40)
        assert await gateway.shared.write() == 0
        assert await gateway.shared.read() == 0
        assert not gateway.store.up
        assert gateway.worker(2).latency.predict(1000, 0, 2) is None
    finally:
        await gateway.store.close()
