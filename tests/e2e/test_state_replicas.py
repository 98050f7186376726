"""Three gateway replicas sharing one real store (redis-server on 127.0.0.1), as an
operator runs them: one tenant's budget admitted once, not three times; a route set on
one replica served by the others and kept across their restarts; a session kept on its
worker whichever replica takes it; the store killed mid-run costs no call, is said in the
log and the metrics, and state is shared again once it is back; junk planted in the
store is refused with a log line."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from redis.asyncio import Redis

from gateway.admin.v1 import admin_pb2 as pb
from gateway_sim.client import channel, collect, model_md, sgl_generate, sgl_grpc, write_config
from gateway_sim.launch import Child, worker_url
from gateway_sim.redis_server import RedisServer
from tests.support.helpers import logged_events, request_events
from tests.support.launch import Launcher
from tests.support.processes import admin_stub, scrape
from tests.support.waits import until

PER_MINUTE = 6


def replicas(
    gateway: Launcher,
    tmp_path: Path,
    redis_server: RedisServer,
    config: Mapping[str, object],
    count: int = 3,
) -> list[Child]:
    state = {"url": redis_server.url, "retry_s": 0.2, "resync_s": 0.5}
    path = write_config(tmp_path, {**config, "state": state})
    return [gateway("--config", path) for _ in range(count)]


def aliased(sim: Launcher) -> dict[str, object]:
    """Workers of models v2 and v3, and the alias `chat` the file routes to v2."""
    v2, v3 = sim("--model", "v2"), sim("--model", "v3")
    return {
        "workers": [
            worker_url(v2, model="v2", runtime="sglang"),
            worker_url(v3, model="v3", runtime="sglang"),
        ],
        "models": {"chat": {"route": [{"model": "v2", "weight": 100}]}},
    }


async def generate(gw: Child, model: str, *md: tuple[str, str]) -> grpc.StatusCode:
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_generate("r"), metadata=(*model_md(model), *md), timeout=10)
        _, error = await collect(call)
    return grpc.StatusCode.OK if error is None else error.code()


async def route_of(gw: Child, alias: str) -> list[tuple[str, int]]:
    ch, admin = admin_stub(gw)
    async with ch:
        listed = await admin.ListRoutes(pb.ListRoutesRequest())
    return [(t.model, t.weight) for r in listed.routes if r.alias == alias for t in r.targets]


async def set_route(gw: Child, alias: str, targets: Sequence[tuple[str, int]]) -> None:
    ch, admin = admin_stub(gw)
    async with ch:
        request = pb.SetRouteRequest(
            alias=alias, targets=[pb.RouteTarget(model=m, weight=w) for m, w in targets]
        )
        await admin.SetRoute(request)


def logged(gw: Child, event: str) -> list[dict[str, object]]:
    return logged_events(gw.log_path, event)


async def test_three_replicas_admit_one_tenants_budget_once(
    sim: Launcher, gateway: Launcher, tmp_path: Path, redis_server: RedisServer
) -> None:
    worker = sim("--model", "m")
    config = {
        "workers": [worker_url(worker, model="m", runtime="sglang")],
        "tenants": {"default": {"requests_per_minute": PER_MINUTE}},
    }
    gws = replicas(gateway, tmp_path, redis_server, config)
    codes = [await generate(gws[i % 3], "m") for i in range(3 * PER_MINUTE)]
    assert codes.count(grpc.StatusCode.OK) == PER_MINUTE  # one budget, not three
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


async def test_a_route_set_on_one_replica_is_served_by_all_and_kept_across_restarts(
    sim: Launcher, gateway: Launcher, tmp_path: Path, redis_server: RedisServer
) -> None:
    config = aliased(sim)
    gws = replicas(gateway, tmp_path, redis_server, config)
    await set_route(gws[0], "chat", [("v3", 100)])

    async def everywhere() -> bool:
        return all([await route_of(gw, "chat") == [("v3", 100)] for gw in gws])

    started = asyncio.get_running_loop().time()
    await until(everywhere, what="every replica follows the route")
    followed_s = asyncio.get_running_loop().time() - started
    assert followed_s < 5.0, followed_s  # a notice: milliseconds (a missed one: resync_s)
    assert await generate(gws[2], "chat") == grpc.StatusCode.OK
    assert request_events(gws[2].log_path, "Generate")[-1]["target"] == "v3"
    for gw in gws:
        gw.stop()
    again = replicas(gateway, tmp_path, redis_server, config)  # the file still says v2
    for gw in again:
        assert await route_of(gw, "chat") == [("v3", 100)]  # read before READY


async def test_a_session_keeps_its_worker_whichever_replica_takes_it(
    sim: Launcher, gateway: Launcher, tmp_path: Path, redis_server: RedisServer
) -> None:
    workers = [sim("--model", "m") for _ in range(3)]
    config = {
        "workers": [worker_url(w, model="m", runtime="sglang") for w in workers],
        "affinity": {"header": "x-session-id"},
        "default_policy": "round_robin",
    }
    gws = replicas(gateway, tmp_path, redis_server, config)
    session = ("x-session-id", "conversation-1")
    for i in range(9):
        assert await generate(gws[i % 3], "m", session) == grpc.StatusCode.OK
    served = {e["worker"] for gw in gws for e in request_events(gw.log_path, "Generate")}
    assert len(served) == 1  # round robin alone would have used all three


async def test_the_store_killed_mid_run_costs_no_call_and_state_is_shared_again(
    sim: Launcher, gateway: Launcher, tmp_path: Path, redis_server: RedisServer
) -> None:
    config = {**aliased(sim), "tenants": {"default": {"requests_per_minute": 1000}}}
    gws = replicas(gateway, tmp_path, redis_server, config, count=2)
    assert await generate(gws[0], "chat") == grpc.StatusCode.OK
    redis_server.stop()
    codes = [await generate(gws[i % 2], "chat") for i in range(10)]
    assert set(codes) == {grpc.StatusCode.OK}  # served on each replica's own state
    await until(lambda: all(logged(gw, "state_store_away") for gw in gws), what="said")
    assert all(len(logged(gw, "state_store_away")) == 1 for gw in gws)  # once
    assert scrape(gws[0])["gateway_state_store_up"] == 0.0
    await set_route(gws[0], "chat", [("v3", 100)])  # while away: here at once
    assert await route_of(gws[0], "chat") == [("v3", 100)]
    assert await route_of(gws[1], "chat") == [("v2", 100)]
    redis_server.start()  # back, empty, on the same port

    async def resynced() -> bool:
        return await route_of(gws[1], "chat") == [("v3", 100)]

    await until(resynced, what="the change made while away reaches the other replica")
    await until(lambda: scrape(gws[0])["gateway_state_store_up"] == 1.0, what="up again")
    assert logged(gws[0], "state_store_back")


async def test_junk_planted_in_the_store_is_refused_with_a_log_line(
    sim: Launcher, gateway: Launcher, tmp_path: Path, redis_server: RedisServer
) -> None:
    v2 = sim("--model", "v2")
    config = {
        "workers": [worker_url(v2, model="v2", runtime="sglang")],
        "models": {"chat": {"route": [{"model": "v2", "weight": 100}]}},
        "tenants": {"default": {"requests_per_minute": 1000}},
    }
    (gw,) = replicas(gateway, tmp_path, redis_server, config, count=1)
    raw = Redis.from_url(redis_server.url)
    try:
        await raw.hset("gateway:routes", "chat", b"\x00" * 200_000)  # past max_value_bytes
        await raw.publish("gateway:routes:changed", "chat")
        await until(lambda: bool(logged(gw, "state_store_invalid")), what="refused, said")
        assert await route_of(gw, "chat") == [("v2", 100)]
        assert await generate(gw, "chat") == grpc.StatusCode.OK
    finally:
        await raw.aclose()


async def test_the_serving_processes_of_one_gateway_charge_one_budget(
    sim: Launcher, gateway: Launcher, tmp_path: Path, redis_server: RedisServer
) -> None:
    """`--processes 2` with a store: each process charges the store the whole budget (a
    process's share would shrink the fleet's to it), so the gateway admits it once."""
    worker = sim("--model", "m")
    config = {
        "workers": [worker_url(worker, model="m", runtime="sglang")],
        "tenants": {"default": {"requests_per_minute": PER_MINUTE}},
        "processes": 2,
    }
    (gw,) = replicas(gateway, tmp_path, redis_server, config, count=1)
    codes = [await generate(gw, "m") for _ in range(2 * PER_MINUTE)]  # a connection each
    assert codes.count(grpc.StatusCode.OK) == PER_MINUTE
