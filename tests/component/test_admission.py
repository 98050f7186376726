"""The gateway's own concurrency bound: past `limits.max_inflight_requests` a call is
refused at once with GATEWAY_OVERLOADED; the engine HealthCheck stays open."""

from __future__ import annotations

from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.helpers import assert_verdict
from tests.support.inproc import client, gateway, idle, sim
from tests.support.waits import until

M = model_md("m")


async def test_calls_past_the_gateway_limit_are_refused_at_once() -> None:
    settings: dict[str, Any] = {"limits.max_inflight_requests": 1}
    async with (
        sim("--model", "m", "--ttft-ms", "30000") as w,
        gateway(w.url(model="m", runtime="sglang"), **settings) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = stub.Generate(sgl_generate("held"), metadata=M)
        await until(lambda: gw.parts.admission.active == 1)
        _, error = await collect(stub.Generate(sgl_generate("shed"), metadata=M))
        assert error is not None
        assert_verdict(
            error,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "GATEWAY_OVERLOADED",
            "The gateway is at its limit of 1 concurrent requests",
            {"model": "", "leg": "", "httpStatus": "429", "code": "gateway_overloaded"},
            retry_s=1,
            pushback_ms=1000,
        )
        health = await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=M)
        assert health.healthy is True
        held.cancel()
        await idle(gw)
        await until(lambda: gw.parts.admission.active == 0)
        messages, error = await collect(
            stub.Generate(sgl_generate("after"), metadata=model_md("m", ("x-sim-ttft-ms", "0")))
        )
        assert error is None and len(messages) == 5
