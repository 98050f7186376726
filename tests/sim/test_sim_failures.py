"""The simulated worker's failures, spoken to over real protos (hosted, or a real process where
the test is about the process: see tests/sim/conftest.py): requests refused in each
engine's own words, failures at the start or after k messages (per request too), a process
exiting mid-stream; aborts, cancels and stalls."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from tests.sim.conftest import SimProcess
from tests.support.sim import StartSim
from tests.support.sim_calls import (
    PROMPT,
    _running_is,
    channel,
    drain,
    drain_until_error,
    running,
    sgl_request,
    vllm_request,
)
from tests.support.waits import WAIT_S, until


async def read_rest(call: Any) -> list[Any]:
    """Drain a call already read with ``read()`` (gRPC forbids mixing in iteration)."""
    messages: list[Any] = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def trailers(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    return dict(error.trailing_metadata() or ())


VLLM_REFUSALS = [
    ([], None, "The decoder prompt cannot be empty"),
    (
        list(range(65)),
        None,
        "The decoder prompt (length 65) is longer than the maximum model length of 64. "
        "Make sure that `max_model_len` is no smaller than the number of text tokens.",
    ),
    (
        list(range(64)),
        None,
        "The decoder prompt (length 64) plus the number of requested output tokens (at "
        "least 1) is longer than the maximum model length of 64. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
        "output tokens).",
    ),
    ([5, 512, 7], None, "Token id 512 is out of vocabulary"),
    (PROMPT, 0, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
]


@pytest.mark.parametrize(("input_ids", "max_tokens", "message"), VLLM_REFUSALS)
async def test_vllm_refuses_with_its_own_words(
    start_sim: StartSim, input_ids: list[int], max_tokens: int | None, message: str
) -> None:
    sim = start_sim("--runtime", "vllm", "--max-model-len", "64")
    request = vllm_request(max_tokens=max_tokens)
    request.tokenized.input_ids[:] = input_ids
    async with channel(sim) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(request, timeout=5)
        messages, error = await drain_until_error(call)
        headers = dict(await call.initial_metadata())
    assert messages == [] and "x-sim-worker" not in headers  # Trailers-Only
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == message


SGLANG_REFUSALS = [
    (
        list(range(58)),
        "Input length (58 tokens) exceeds the maximum allowed length (58 tokens). Use a "
        "shorter input or enable --allow-auto-truncate.",
    ),
    (
        [5, 512, 7],
        "The input_ids [5, 512, 7] contains values greater than the vocab size (512).",
    ),
    (None, "Tokenized input must be provided"),
]


@pytest.mark.parametrize(("input_ids", "message"), SGLANG_REFUSALS)
async def test_sglang_refuses_with_its_own_words(
    start_sim: StartSim, input_ids: list[int] | None, message: str
) -> None:
    sim = start_sim("--max-model-len", "64")
    request = sgl_request()
    if input_ids is None:
        request.ClearField("tokenized")
    else:
        request.tokenized.input_ids[:] = input_ids
    async with channel(sim) as ch:
        messages, error = await drain_until_error(
            sgl_grpc.SglangSchedulerStub(ch).Generate(request, timeout=5)
        )
        fine = await drain(
            sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_request(input_ids=list(range(57)), max_new_tokens=1)
            )
        )
    assert messages == []
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == message
    assert fine[-1].complete.completion_tokens == 1  # one short of the bound is taken


# ------------------------------------------------------------------------------ failures


async def test_fail_at_start_is_trailers_only(start_sim: StartSim) -> None:
    sim = start_sim("--fail-code", "UNAVAILABLE", "--name", "bad-worker")
    async with channel(sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_request(), timeout=5)
        messages, error = await drain_until_error(call)
        headers = dict(await call.initial_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as embed_error:
            await stub.Embed(
                sgl_pb2.EmbedRequest(tokenized=sgl_pb2.TokenizedInput(input_ids=PROMPT))
            )
        assert await running(stub) == 0
    assert messages == []
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "simulated failure"
    assert trailers(error)["x-sim-failure"] == "bad-worker"
    assert "x-sim-worker" not in headers
    assert embed_error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert trailers(embed_error.value)["x-sim-failure"] == "bad-worker"


async def test_fail_after_k_messages(start_sim: StartSim) -> None:
    sim = start_sim("--runtime", "vllm", "--fail-code", "internal", "--fail-after", "2")
    async with channel(sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        call = stub.Generate(vllm_request(max_tokens=8))
        messages, error = await drain_until_error(call)
        headers = dict(await call.initial_metadata())
        # Shorter than the trigger point: all messages, then the failure anyway.
        short, short_error = await drain_until_error(stub.Generate(vllm_request(stream=False)))
    assert len(messages) == 2
    assert error.code() == grpc.StatusCode.INTERNAL
    assert trailers(error)["x-sim-failure"] == f"vllm@{sim.address}"
    assert headers["x-sim-worker"] == f"vllm@{sim.address}"
    assert len(short) == 1
    assert short_error.code() == grpc.StatusCode.INTERNAL


async def test_per_request_overrides(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        failing = (
            ("x-sim-fail-code", "FAILED_PRECONDITION"),
            ("x-sim-fail-after", "3"),
            ("x-sim-tokens", "10"),
        )
        messages, error = await drain_until_error(stub.Generate(sgl_request(), metadata=failing))
        short = await drain(stub.Generate(sgl_request(), metadata=(("x-sim-tokens", "4"),)))
        started = time.monotonic()
        timed = await drain(
            stub.Generate(
                sgl_request(max_new_tokens=4),
                metadata=(("x-sim-ttft-ms", "60"), ("x-sim-token-ms", "30")),
            )
        )
        elapsed = time.monotonic() - started
        bad, bad_error = await drain_until_error(
            stub.Generate(sgl_request(), metadata=(("x-sim-tokens", "many"),))
        )
        # The worker's own behaviour is untouched by the overrides above.
        plain = await drain(stub.Generate(sgl_request()))
    assert len(messages) == 3
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trailers(error)["x-sim-failure"] == "sgl-shared"
    assert len(short) == 5
    assert len(timed) == 5 and elapsed >= 0.15
    assert bad == [] and bad_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-sim-tokens" in (bad_error.details() or "")
    assert len(plain) == 17


@pytest.mark.sim_processes  # the process exits
async def test_exit_after_kills_process_mid_stream(start_sim: StartSim) -> None:
    sim = start_sim("--exit-after", "3")
    async with channel(sim) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_request(), timeout=10)
        messages, error = await drain_until_error(call)
    assert len(messages) == 3
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert sim.process.wait(WAIT_S) == 1


# ------------------------------------------------------------------- abort, cancel, stall


async def test_sglang_abort_leaves_the_stream_open(sglang_sim: SimProcess) -> None:
    """As SGLang's servicer: the request stops (no longer running) but its stream gets
    nothing more, no Complete and no status, until its deadline."""
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(
            sgl_request("ab-open", max_new_tokens=1000),
            metadata=(("x-sim-token-ms", "20"),),
            timeout=4,
        )
        first = [await call.read(), await call.read()]
        response = await stub.Abort(sgl_pb2.AbortRequest(request_id="ab-open"))
        await until(lambda: _running_is(stub, 0))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await read_rest(call)  # chunks already on their way, then nothing
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (response.success, response.message) == (True, "Request ab-open aborted")
    assert [m.WhichOneof("response") for m in first] == ["chunk", "chunk"]


async def test_sglang_abort_completes_when_told(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(
            sgl_request("ab-1", max_new_tokens=1000),
            metadata=(("x-sim-token-ms", "20"), ("x-sim-abort-completes", "1")),
            timeout=10,
        )
        first = [await call.read(), await call.read()]
        response = await stub.Abort(sgl_pb2.AbortRequest(request_id="ab-1"))
        rest = await read_rest(call)
        missing = await stub.Abort(sgl_pb2.AbortRequest(request_id="no-such-request"))
        assert await call.code() == grpc.StatusCode.OK
        assert await running(stub) == 0
    # The servicer passes an Abort on to the scheduler and says so, found or not.
    assert (response.success, response.message) == (True, "Request ab-1 aborted")
    assert (missing.success, missing.message) == (True, "Request no-such-request aborted")
    *chunks, last_chunk, final = first + rest
    assert final.WhichOneof("response") == "complete"
    assert final.complete.finish_reason == "abort"
    assert list(final.complete.output_ids) == []  # the last chunk's: none
    assert list(last_chunk.chunk.token_ids) == []
    assert 2 <= final.complete.completion_tokens < 1000
    assert len(chunks) == final.complete.completion_tokens == last_chunk.chunk.completion_tokens


async def test_vllm_abort_stalled_and_streaming(vllm_sim: SimProcess) -> None:
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        stalled = stub.Generate(vllm_request("v-stall"), metadata=(("x-sim-stall", "1"),))
        slow = stub.Generate(vllm_request("v-slow"), metadata=(("x-sim-token-ms", "50"),))
        await slow.read()
        await until(lambda: _running_is(stub, 2))
        await stub.Abort(vllm_pb2.AbortRequest(request_ids=["v-stall", "v-slow", "v-none"]))
        stalled_messages = await drain(stalled)
        slow_rest = await read_rest(slow)
        assert await running(stub) == 0
    # vLLM's final output for an aborted request: no new token, finish_reason abort.
    assert [m.WhichOneof("response") for m in stalled_messages] == ["chunk", "complete"]
    assert list(stalled_messages[0].chunk.token_ids) == []
    assert stalled_messages[1].complete.finish_reason == "abort"
    assert list(stalled_messages[1].complete.output_ids) == []
    assert slow_rest[-1].complete.finish_reason == "abort"
    assert list(slow_rest[-2].chunk.token_ids) == [] and slow_rest[-2].chunk.completion_tokens == 0


async def test_cancel_returns_active_count_to_zero(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        stalled = stub.Generate(sgl_request("c-1"), metadata=(("x-sim-stall", "1"),))
        slow = stub.Generate(sgl_request("c-1"), metadata=(("x-sim-token-ms", "50"),))
        await slow.read()
        await until(lambda: _running_is(stub, 2))
        info = await stub.GetServerInfo(sgl_pb2.GetServerInfoRequest())
        assert info.active_requests == 2
        stalled.cancel()
        slow.cancel()
        await until(lambda: _running_is(stub, 0))


async def test_stall_until_client_deadline(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_request(), metadata=(("x-sim-stall", "1"),), timeout=0.3)
        messages, error = await drain_until_error(call)
        with pytest.raises(grpc.aio.AioRpcError) as embed_error:
            await stub.Embed(
                sgl_pb2.EmbedRequest(tokenized=sgl_pb2.TokenizedInput(input_ids=PROMPT)),
                metadata=(("x-sim-stall", "1"),),
                timeout=0.3,
            )
        await until(lambda: _running_is(stub, 0))
    assert messages == []
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert embed_error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
