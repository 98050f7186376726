"""The simulated SGLang worker's LoRA adapters: a bounded number loaded, loads that take
time, and a Generate naming an adapter it does not hold refused as SGLang refuses it."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from tests.support.sim import StartSim


def load(name: str) -> Any:
    return sgl_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=f"/l/{name}", lora_id=name)


def generate(lora_id: str) -> Any:
    return sgl_pb2.GenerateRequest(
        request_id=f"r-{lora_id}",
        tokenized=sgl_pb2.TokenizedInput(input_ids=[5, 7, 11]),
        sampling_params=sgl_pb2.SamplingParams(max_new_tokens=2),
        stream=True,
        lora_id=lora_id,
    )


async def drain(call: Any) -> list[Any]:
    return [message async for message in call]


async def test_loads_past_max_loras_fail_until_one_is_unloaded(start_sim: StartSim) -> None:
    sim = start_sim("--max-loras", "2")
    async with grpc.aio.insecure_channel(sim.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        first, second = await stub.LoadLoRAAdapter(load("a")), await stub.LoadLoRAAdapter(load("b"))
        again = await stub.LoadLoRAAdapter(load("a"))  # held already: no new slot needed
        third = await stub.LoadLoRAAdapter(load("c"))
        await stub.UnloadLoRAAdapter(sgl_pb2.UnloadLoRAAdapterRequest(lora_id="a"))
        after = await stub.LoadLoRAAdapter(load("c"))
    assert first.success and second.success and again.success
    assert not third.success and "maximum number of loaded LoRA adapters (2)" in third.message
    assert list(third.loaded_lora_ids) == ["a", "b"]
    assert after.success and list(after.loaded_lora_ids) == ["b", "c"]


async def test_max_loras_zero_refuses_every_load(start_sim: StartSim) -> None:
    sim = start_sim("--max-loras", "0")
    async with grpc.aio.insecure_channel(sim.address) as ch:
        reply = await sgl_grpc.SglangSchedulerStub(ch).LoadLoRAAdapter(load("a"))
    assert not reply.success and list(reply.loaded_lora_ids) == []


async def test_a_load_takes_lora_load_ms(start_sim: StartSim) -> None:
    sim = start_sim("--max-loras", "2", "--lora-load-ms", "200")
    async with grpc.aio.insecure_channel(sim.address) as ch:
        started = time.monotonic()
        reply = await sgl_grpc.SglangSchedulerStub(ch).LoadLoRAAdapter(load("a"))
    assert reply.success and time.monotonic() - started >= 0.2


async def test_generate_needs_its_adapter_loaded(start_sim: StartSim) -> None:
    sim = start_sim("--max-loras", "2")
    async with grpc.aio.insecure_channel(sim.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await drain(stub.Generate(generate("a")))
        await stub.LoadLoRAAdapter(load("a"))
        served = await drain(stub.Generate(generate("a")))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "requested LoRA adapters are not loaded: {'a'}" in (refused.value.details() or "")
    assert served[-1].WhichOneof("response") == "complete"


async def test_without_max_loras_any_adapter_is_taken(start_sim: StartSim) -> None:
    sim = start_sim()
    async with grpc.aio.insecure_channel(sim.address) as ch:
        served = await drain(sgl_grpc.SglangSchedulerStub(ch).Generate(generate("any")))
    assert served[-1].WhichOneof("response") == "complete"
