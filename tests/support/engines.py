"""What the real-engine tests share (tests/engines): prompts over the tiny model's
vocabulary, greedy requests of either engine and the token ids a call generated, an
engine's own load, a worker's log, the gateway's request line of one call, and how far
`predicted_latency`'s predictions on those lines fell from what was observed."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from gateway_sim.client import channel, model_md, sgl, sgl_grpc, trailers, vllm, vllm_grpc
from scripts.engines.sglang_worker import SGLANG_SERVICE
from scripts.engines.worker import EngineWorker
from tests.support.helpers import request_events, rich_status

VOCAB = 512
WAIT_S = 90.0  # bounded waits for a state on a busy 2-core machine
PREFILL_KV = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})


def prompt(length: int, salt: int = 0) -> list[int]:
    """Token ids the tiny model knows (1 .. VOCAB-1), distinct per salt."""
    return [1 + (i * 37 + salt * 101) % (VOCAB - 1) for i in range(length)]


def greedy(
    request_id: str, tokens: Sequence[int], max_tokens: int = 24, stream: bool = True
) -> Any:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=list(tokens)),
        sampling_params=vllm.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ),
        stream=stream,
    )


def sglang_greedy(
    request_id: str, tokens: Sequence[int], max_new: int = 24, stream: bool = True
) -> Any:
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=list(tokens)),
        sampling_params=sgl.SamplingParams(
            temperature=0.0, max_new_tokens=max_new, ignore_eos=True
        ),
        stream=stream,
    )


def engine_stub(ch: aio.Channel, req: Any) -> Any:
    """The stub of the engine whose request `req` is."""
    if isinstance(req, sgl.GenerateRequest):
        return sgl_grpc.SglangSchedulerStub(ch)
    return vllm_grpc.VllmEngineStub(ch)


async def streamed(
    address: str, req: Any, model: str = "", headers: Sequence[tuple[str, str]] = ()
) -> tuple[list[int], aio.AioRpcError | None]:
    """The token ids a Generate of either engine got (of choice 0 with n > 1: `choices`),
    in order, and its error if it failed: its chunks' ids, or an unstreamed call's
    Complete's (a streamed Complete repeats ids the chunks had)."""
    by_choice, error = await choices(address, req, model, headers)
    return by_choice.get(0, []), error


async def choices(
    address: str, req: Any, model: str = "", headers: Sequence[tuple[str, str]] = ()
) -> tuple[dict[int, list[int]], aio.AioRpcError | None]:
    """The token ids of each choice (by index) a Generate got, and its error if it failed;
    `headers`: request metadata beside the model's."""
    tokens: dict[int, list[int]] = {}
    metadata = (*(model_md(model) if model else ()), *headers)
    async with channel(address) as ch:
        call = engine_stub(ch, req).Generate(req, metadata=metadata or None, timeout=120)
        try:
            async for reply in call:
                if reply.HasField("chunk"):
                    tokens.setdefault(reply.chunk.index, []).extend(reply.chunk.token_ids)
                elif not req.stream:
                    tokens.setdefault(reply.complete.index, []).extend(reply.complete.output_ids)
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


async def burst(address: str, requests: Sequence[Any], wanted: int) -> None:
    """All at once: each served in full (`wanted` tokens) or refused RESOURCE_EXHAUSTED
    WORKERS_OVERLOADED with retry info; at least one served. Prints the figures."""
    began = time.monotonic()
    results = await asyncio.gather(*(streamed(address, req, "tiny") for req in requests))
    took = time.monotonic() - began
    served = [tokens for tokens, error in results if error is None]
    refused = [error for _, error in results if error is not None]
    print(f"\n[burst of {len(requests)}] served {len(served)}, refused {len(refused)}, "
          f"{took:.1f} s")  # fmt: skip
    assert served and all(len(tokens) == wanted for tokens in served)
    for error in refused:
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        _, details = rich_status(error)
        assert details["ErrorInfo"].reason == "WORKERS_OVERLOADED"
        assert "RetryInfo" in details


async def one_by_one(address: str, requests: Sequence[Any], wanted: int) -> list[float]:
    """Each call in turn, each served in full (`wanted` tokens): their seconds."""
    took: list[float] = []
    for req in requests:
        began = time.monotonic()
        tokens, error = await streamed(address, req, "tiny")
        took.append(time.monotonic() - began)
        assert error is None and len(tokens) == wanted, error
    return took


# A stall is over three times the median and over this much longer than it: on two cores
# shared by four engines a call now and then waits a few hundred ms for a core (an SGLang
# PD call of a 0.15 s median took 0.47-0.67 s in a whole-tier run); the stalls these tests
# are about take seconds to half a minute.
STALL_FLOOR_S = 1.0


def spread(label: str, took: Sequence[float]) -> tuple[float, list[float]]:
    """The median of the calls' seconds and the stalls among them (over three times the
    median, and over STALL_FLOOR_S longer), printed under `label`: a sequential test's
    figures."""
    median = statistics.median(took)
    slow = [round(t, 2) for t in took if t > 3 * median and t - median > STALL_FLOOR_S]
    print(f"\n[{label}] median {median:.3f} s, max {max(took):.3f} s, stalls: {slow}")
    return median, slow


async def until_unavailable(address: str, req: Any, leg: str) -> None:
    """Send `req` until the gateway's verdict is UNAVAILABLE WORKERS_UNAVAILABLE for
    `leg` (a worker of it just killed), never NOT_FOUND; the first calls may meet the
    dying worker itself (its own UNAVAILABLE, no details). The verdict comes at once,
    with retry info."""
    deadline = time.monotonic() + WAIT_S
    while True:
        began = time.monotonic()
        _, error = await streamed(address, req, "tiny")
        assert error is not None
        assert error.code() is not grpc.StatusCode.NOT_FOUND
        details = rich_status(error)[1] if "grpc-status-details-bin" in trailers(error) else {}
        info = details.get("ErrorInfo")
        if info is not None and info.reason == "WORKERS_UNAVAILABLE":
            break
        assert time.monotonic() < deadline, error.details()
        await asyncio.sleep(0.2)
    assert time.monotonic() - began < 5.0  # a verdict, not a wait
    assert info.metadata["leg"] == leg
    assert "RetryInfo" in details


CANCEL_WHEN = ("before the first token", "after the first token")


async def cancelled(address: str, req: Any, when: str) -> None:
    """A Generate the client cancels `when` (one of CANCEL_WHEN): 50 ms in, a PD call's
    prefill still under way, or at its first chunk."""
    async with channel(address) as ch:
        call = engine_stub(ch, req).Generate(req, metadata=model_md("tiny"))
        if when == CANCEL_WHEN[0]:
            await asyncio.sleep(0.05)
            call.cancel()
            return
        async for reply in call:
            if reply.HasField("chunk"):
                call.cancel()
                return


def prediction_errors(lines: Sequence[dict[str, Any]]) -> list[float]:
    """|predicted - observed| / observed time to first message of each request line with
    a prediction (`predicted_latency`'s)."""
    return [
        abs(line["predicted_first_message_ms"] - line["first_message_ms"])
        / line["first_message_ms"]
        for line in lines
        if line["predicted_first_message_ms"] is not None
    ]
