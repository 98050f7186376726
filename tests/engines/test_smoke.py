"""The gateway in front of a real vLLM gRPC worker: discovery, a relayed stream, health."""

from __future__ import annotations

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_sim.client import admin_address, channel, model_md, vllm, vllm_grpc
from scripts.engines.worker import ENGINE_SERVICE, EngineWorker
from tests.support.availability import is_ready, wait_worker
from tests.support.launch import Launcher

DISCOVERY_S = 30.0  # bounded wait for the gateway to register a discovered worker


def greedy_request(request_id: str) -> vllm.GenerateRequest:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=[17, 54, 91, 128, 165, 202, 239, 276]),
        sampling_params=vllm.SamplingParams(temperature=0.0, seed=7, max_tokens=12),
        stream=True,
    )


async def streamed_tokens(
    address: str, request: vllm.GenerateRequest, model: str = ""
) -> list[int]:
    """Every token id of a streamed Generate, in order (index 0); the Complete's finish
    reason must be there."""
    tokens: list[int] = []
    finish = ""
    async with channel(address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(
            request, metadata=model_md(model) if model else None, timeout=60
        )
        async for reply in call:
            if reply.HasField("chunk"):
                tokens.extend(reply.chunk.token_ids)
            else:
                finish = reply.complete.finish_reason
    assert finish == "length"
    return tokens


async def test_gateway_discovers_the_worker_and_relays_its_tokens(
    engine: EngineWorker, gateway: Launcher
) -> None:
    gw = gateway("--worker", engine.url)  # no model, no runtime: both asked from the worker

    worker = await wait_worker(admin_address(gw), engine.address, is_ready, within_s=DISCOVERY_S)
    assert (worker.model, worker.runtime) == ("tiny", "vllm")

    direct = await streamed_tokens(engine.address, greedy_request("smoke-direct"))
    through = await streamed_tokens(gw.address, greedy_request("smoke-gateway"), model="tiny")
    assert len(direct) == 12
    assert through == direct  # greedy: the same tokens whichever way the call went

    async with aio.insecure_channel(gw.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", ENGINE_SERVICE, "models/tiny"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
