"""What the real-engine tests share (tests/engines): prompts over the tiny model's
vocabulary, greedy vLLM requests and a streamed call's token ids, an engine's own load
(either engine), a worker's log, and the gateway's request line of one call."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpc import aio

from scripts.engines.sglang_worker import SGLANG_SERVICE
from scripts.engines.worker import EngineWorker
from tests.support.helpers import (
    channel,
    model_md,
    request_events,
    sgl,
    sgl_grpc,
    vllm,
    vllm_grpc,
)

VOCAB = 512
WAIT_S = 90.0  # bounded waits for a state on a busy 2-core machine
PREFILL_KV = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})


def prompt(length: int, salt: int = 0) -> list[int]:
    """Token ids the tiny model knows (1 .. VOCAB-1), distinct per salt."""
    return [1 + (i * 37 + salt * 101) % (VOCAB - 1) for i in range(length)]


def greedy(request_id: str, tokens: Sequence[int], max_tokens: int = 24) -> Any:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=list(tokens)),
        sampling_params=vllm.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ),
        stream=True,
    )


async def streamed(
    address: str, req: Any, model: str = ""
) -> tuple[list[int], aio.AioRpcError | None]:
    tokens: list[int] = []
    async with channel(address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(
            req, metadata=model_md(model) if model else None, timeout=120
        )
        try:
            async for reply in call:
                if reply.HasField("chunk"):
                    tokens.extend(reply.chunk.token_ids)
        except aio.AioRpcError as error:
            return tokens, error
    return tokens, None


async def load_on(worker: EngineWorker) -> int:
    """Requests running or waiting on the worker, as its own GetLoads says."""
    async with channel(worker.address) as ch:
        if worker.engine_service == SGLANG_SERVICE:
            stub: Any = sgl_grpc.SglangSchedulerStub(ch)
            reply = await stub.GetLoads(sgl.GetLoadsRequest(), timeout=10)
        else:
            reply = await vllm_grpc.VllmEngineStub(ch).GetLoads(vllm.GetLoadsRequest(), timeout=10)
    return sum(x.num_running_reqs + x.num_waiting_reqs for x in reply.loads)


async def wait_idle(*workers: EngineWorker) -> None:
    deadline = time.monotonic() + WAIT_S
    for worker in workers:
        while await load_on(worker):
            assert time.monotonic() < deadline, f"{worker.address} still has requests"
            await asyncio.sleep(0.1)


def log_of(worker: EngineWorker) -> str:
    return worker.log_path.read_text(errors="replace") if worker.log_path.exists() else ""


def logged(log_path: Path, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [e for e in request_events(log_path, "Generate") if e["request_id"] == request_id]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no request line for {request_id}"
        time.sleep(0.05)
