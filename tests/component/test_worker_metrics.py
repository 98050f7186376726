"""Series a dashboard draws, from real calls in process: each worker's answers by code,
its time to first message and between messages (the series go with the worker), and the
prompt tokens of calls whatever the policy."""

from __future__ import annotations

import pytest

from gateway_sim.client import collect, model_md, sgl_generate, sgl_grpc
from tests.support.inproc import client, gateway, idle, recorded, sim
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)


async def test_each_workers_answers_are_counted_and_timed_and_go_with_it() -> None:
    async with (
        sim("--model", "m", "--token-ms", "5") as first,
        sim("--model", "m", "--token-ms", "5") as second,
        gateway(
            first.url(model="m", runtime="sglang"),
            second.url(model="m", runtime="sglang"),
            default_policy="round_robin",
        ) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(6):
            _, error = await collect(
                stub.Generate(sgl_generate(f"r{i}", tokens=4), metadata=model_md("m"))
            )
            assert error is None
        await until(lambda: len(records) == 6)
        await idle(gw)
        metric = gw.parts.metrics.prometheus.get_sample_value
        by_worker = {r.worker for r in records if r.worker is not None}
        assert len(by_worker) == 2
        for worker in by_worker:
            served = sum(1 for r in records if r.worker == worker)
            assert metric("gateway_worker_requests_total", {"worker": worker, "code": "OK"}) == (
                served
            )
            where = {"worker": worker}
            assert metric("gateway_worker_first_message_seconds_count", where) == served
            assert metric("gateway_worker_inter_token_seconds_count", where) == served
            bucketed = metric(
                "gateway_worker_first_message_seconds_bucket", {**where, "le": "+Inf"}
            )
            assert bucketed == served
        prompt = sum(r.prompt_tokens for r in records)
        assert prompt > 0  # counted under round robin too, not only cache-aware
        assert metric("gateway_prompt_tokens_total", {"model": "m"}) == prompt
        gone = next(iter(by_worker))
        leaving = gw.parts.fleet.registry.get(gone)
        assert leaving is not None
        await gw.parts.fleet.remove(leaving, 1.0)
        assert metric("gateway_worker_requests_total", {"worker": gone, "code": "OK"}) is None
