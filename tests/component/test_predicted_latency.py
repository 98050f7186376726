"""Predicted-latency placement in process, learning from its own calls: two simulated
workers, one ten times slower to its first token; once each worker's model is warm
(from the calls cache-aware placement spread over both), the calls go to the fast one,
but for the one placement in EXPLORE_EVERY that explores."""

from __future__ import annotations

from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.placement.policies.predicted_latency import EXPLORE_EVERY
from gateway.upstream.latency import MIN_SEEN
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.inproc import client, gateway, idle, recorded, sim, worker
from tests.support.latency import warm_up


async def test_calls_go_where_the_first_token_comes_sooner() -> None:
    async with (
        sim("--model", "m", "--ttft-ms", "3") as fast,
        sim("--model", "m", "--ttft-ms", "3", "--speed", "0.1") as slow,
        gateway(
            fast.url(model="m", runtime="sglang"),
            slow.url(model="m", runtime="sglang"),
            default_policy="predicted_latency",
        ) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        records = recorded(gw)
        models = [worker(gw, w).latency for w in (fast, slow)]
        await warm_up(stub, lambda: min(m.seen for m in models) >= MIN_SEEN, 20 * MIN_SEEN)
        warm = len(records)
        for i in range(2 * EXPLORE_EVERY):
            _, error = await collect(stub.Generate(sgl_generate(f"r{i}"), metadata=model_md("m")))
            assert error is None
        placed = [r.worker for r in records[warm:]]
        assert placed.count(fast.address) >= 2 * EXPLORE_EVERY - 2  # two may explore
        slow_s = worker(gw, slow).latency.predict(0, 0, 0)
        fast_s = worker(gw, fast).latency.predict(0, 0, 0)
        assert slow_s is not None and fast_s is not None and slow_s > 2 * fast_s
        await idle(gw)
        assert worker(gw, fast).prefill_backlog == worker(gw, slow).prefill_backlog == 0
