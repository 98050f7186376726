"""Calls to a simulated worker over real protos, for the simulator's own tests
(tests/sim/test_sim*.py): a channel to it, SGLang and vLLM requests for PROMPT, draining a
stream (to its end, or to its error), the running count, an error's trailers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

from tests.sim.conftest import SimProcess

PROMPT = [5, 7, 11]


@asynccontextmanager
async def channel(sim: SimProcess) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(sim.address) as ch:
        yield ch


def sgl_request(
    request_id: str = "req",
    *,
    stream: bool = True,
    max_new_tokens: int | None = None,
    n: int = 0,
    input_ids: list[int] = PROMPT,
) -> Any:
    params = sgl_pb2.SamplingParams(n=n)
    if max_new_tokens is not None:
        params.max_new_tokens = max_new_tokens
    return sgl_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=sgl_pb2.TokenizedInput(input_ids=input_ids),
        sampling_params=params,
        stream=stream,
    )


def vllm_request(
    request_id: str = "req", *, stream: bool = True, max_tokens: int | None = None, n: int = 0
) -> Any:
    """A vLLM GenerateRequest for PROMPT."""
    params = vllm_pb2.SamplingParams(n=n)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    return vllm_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=params,
        stream=stream,
    )


async def drain(call: Any) -> list[Any]:
    return [message async for message in call]


async def drain_until_error(call: Any) -> tuple[list[Any], grpc.aio.AioRpcError]:
    messages: list[Any] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for message in call:
            messages.append(message)
    return messages, info.value


async def running(stub: Any) -> int:
    loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest(dp_rank=0), timeout=5)
    return int(loads.loads[0].num_running_reqs)


async def _running_is(stub: Any, count: int) -> bool:
    return await running(stub) == count
