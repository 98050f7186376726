"""A restarted gateway predicts from its first call: the latency models one gateway
learned of its workers, written to a real store (redis-server on 127.0.0.1), are read by
the next gateway that starts on the same store (gateway.state.latency); without the store
its first calls are placed without predictions."""

from __future__ import annotations

from pathlib import Path

from redis.asyncio import Redis

from gateway.state.store import digest
from gateway.upstream.latency import MIN_SEEN
from gateway_sim.client import channel, collect, model_md, sgl_generate, sgl_grpc, write_config
from gateway_sim.launch import Child, worker_url
from gateway_sim.redis_server import RedisServer
from tests.support.helpers import logged_events, wait_for_events
from tests.support.launch import Launcher
from tests.support.waits import until


async def generate(gw: Child, request_id: str) -> None:
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_generate(request_id, tokens=4), metadata=model_md("m"), timeout=10)
        _, error = await collect(call)
    assert error is None


def predicted_ms(gw: Child, request_id: str) -> object:
    (event,) = wait_for_events(gw.log_path, 1, request_id=request_id)
    return event["predicted_first_message_ms"]


async def test_a_restarted_gateway_predicts_from_its_first_call(
    sim: Launcher, gateway: Launcher, tmp_path: Path, redis_server: RedisServer
) -> None:
    worker = sim("--model", "m")
    url = worker_url(worker, model="m", runtime="sglang")
    config = {
        "workers": [url],
        "state": {"url": redis_server.url, "retry_s": 0.2},
    }
    path = write_config(tmp_path, config)
    first = gateway("--config", path, "--policy", "predicted_latency")
    await generate(first, "cold")
    assert predicted_ms(first, "cold") is None  # nothing learned yet, nothing stored
    for i in range(MIN_SEEN):
        await generate(first, f"warm-{i}")
    await generate(first, "warm")
    assert isinstance(predicted_ms(first, "warm"), float)

    raw = Redis.from_url(redis_server.url)
    try:  # written within its publishing period
        key = f"gateway:latency:{digest(worker.address)}"

        async def written() -> bool:
            return bool(await raw.exists(key))

        await until(written, what="the model written to the store")
    finally:
        await raw.aclose()
    first.stop()

    second = gateway("--config", path, "--policy", "predicted_latency")
    await until(
        lambda: bool(logged_events(second.log_path, "latency_models_adopted")),
        what="the stored model adopted",
    )
    await generate(second, "restarted")
    assert isinstance(predicted_ms(second, "restarted"), float)
