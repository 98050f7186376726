"""End-to-end tests of the simulated worker, spoken to over real protos (hosted, or a real
process where the test is about the process: see tests/sim/conftest.py)."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim.model import embedding_for, output_tokens
from tests.sim.conftest import SimProcess
from tests.support.sim import StartSim
from tests.support.waits import WAIT_S, until

SGL_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
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


async def read_rest(call: Any) -> list[Any]:
    """Drain a call already read with ``read()`` (gRPC forbids mixing in iteration)."""
    messages: list[Any] = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def running(stub: Any) -> int:
    loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest(dp_rank=0), timeout=5)
    return int(loads.loads[0].num_running_reqs)


def trailers(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    return dict(error.trailing_metadata() or ())


# ------------------------------------------------------------------------------ Generate


async def test_sglang_streaming_generate(sglang_sim: SimProcess) -> None:
    """No maximum: the model stops by itself after 16 tokens, the last one EOS. Chunks
    count the choice's total so far; the Complete repeats the last chunk's tokens with
    the totals and names the EOS it stopped on."""
    async with channel(sglang_sim) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_request("s-1"), metadata=(("x-trace", "t1"),), timeout=10
        )
        messages = await drain(call)
        headers = dict(await call.initial_metadata())
        assert await call.code() == grpc.StatusCode.OK

    expected = [*output_tokens(PROMPT, 15), 2]
    assert expected[0] == (PROMPT[0] + len(PROMPT)) % 512
    assert len(messages) == 17
    for k, message in enumerate(messages[:-1]):
        assert message.request_id == "s-1"
        assert message.WhichOneof("response") == "chunk"
        assert list(message.chunk.token_ids) == [expected[k]]
        assert message.chunk.prompt_tokens == 3
        assert message.chunk.completion_tokens == k + 1
        assert message.chunk.index == 0
    final = messages[-1]
    assert final.request_id == "s-1"
    assert final.WhichOneof("response") == "complete"
    assert list(final.complete.output_ids) == [2]  # the last chunk's, again
    assert (final.complete.finish_reason, final.complete.matched_token_id) == ("stop", 2)
    assert (final.complete.prompt_tokens, final.complete.completion_tokens) == (3, 16)

    assert headers["x-sim-worker"] == "sgl-shared"
    # the client's 10 s, as grpc-timeout carried it (its units round up: 10,098 seen once)
    assert 0 < int(headers["x-sim-deadline-ms"]) <= 11_000
    assert "x-trace" in headers["x-sim-seen-metadata"].split(",")


async def test_sglang_non_streaming_request_max_wins(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_request("s-2", stream=False, max_new_tokens=5), metadata=(("x-sim-tokens", "9"),)
        )
        messages = await drain(call)
        headers = dict(await call.initial_metadata())
    assert len(messages) == 1
    assert list(messages[0].complete.output_ids) == output_tokens(PROMPT, 5)
    assert messages[0].complete.completion_tokens == 5
    assert messages[0].complete.finish_reason == "length"
    assert not messages[0].complete.HasField("matched_token_id")
    assert headers["x-sim-deadline-ms"] == "none"


async def test_vllm_streaming_and_non_streaming(vllm_sim: SimProcess) -> None:
    """Deltas: every chunk carries and counts its own token; the Complete repeats the
    last one only. Unstreamed, one Complete holds them all; a stop on EOS names none."""
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        streamed = await drain(stub.Generate(vllm_request(max_tokens=4), timeout=10))
        call = stub.Generate(vllm_request(stream=False), timeout=10)
        whole = await drain(call)
        assert dict(await call.initial_metadata())["x-sim-worker"] == "vllm-shared"

    expected = output_tokens(PROMPT, 4)
    assert [m.WhichOneof("response") for m in streamed] == ["chunk"] * 4 + ["complete"]
    assert [list(m.chunk.token_ids) for m in streamed[:-1]] == [[t] for t in expected]
    assert [m.chunk.completion_tokens for m in streamed[:-1]] == [1, 1, 1, 1]
    assert all(m.chunk.prompt_tokens == 3 for m in streamed[:-1])
    final = streamed[-1].complete
    assert list(final.output_ids) == expected[-1:] and final.completion_tokens == 1
    assert (final.finish_reason, final.prompt_tokens, final.index) == ("length", 3, 0)
    assert len(whole) == 1
    assert list(whole[0].complete.output_ids) == [*output_tokens(PROMPT, 15), 2]
    assert whole[0].complete.completion_tokens == 16
    assert whole[0].complete.finish_reason == "stop"
    assert not whole[0].complete.HasField("matched_token_id")


async def test_n2_indices(sglang_sim: SimProcess, vllm_sim: SimProcess) -> None:
    """n=2 interleaves the choices, each with its index. Unstreamed, vLLM's Completes
    carry their index and SGLang's all say 0 (its servicer sets none)."""
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        sgl = await drain(stub.Generate(sgl_request(max_new_tokens=3, n=2)))
        sgl_whole = await drain(stub.Generate(sgl_request(max_new_tokens=3, n=2, stream=False)))
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        vl = await drain(stub.Generate(vllm_request(max_tokens=3, n=2)))
        vl_whole = await drain(stub.Generate(vllm_request(max_tokens=3, n=2, stream=False)))
    for messages, last_count in ((sgl, 3), (vl, 1)):
        assert len(messages) == 2 * 3 + 2
        chunks = [m.chunk for m in messages if m.WhichOneof("response") == "chunk"]
        completes = [m.complete for m in messages if m.WhichOneof("response") == "complete"]
        assert [c.index for c in chunks] == [0, 1, 0, 1, 0, 1]
        assert sorted(c.index for c in completes) == [0, 1]
        assert all(c.completion_tokens == last_count for c in completes)
    assert [m.complete.index for m in vl_whole] == [0, 1]
    assert [m.complete.index for m in sgl_whole] == [0, 0]
    for whole in (sgl_whole, vl_whole):
        assert all(list(m.complete.output_ids) == output_tokens(PROMPT, 3) for m in whole)
        assert all(m.complete.completion_tokens == 3 for m in whole)


async def test_several_tokens_per_chunk(sglang_sim: SimProcess, vllm_sim: SimProcess) -> None:
    """A reader that lags gets several tokens a chunk: vLLM counts each chunk's own,
    SGLang the total; both Completes repeat the last chunk."""
    per_chunk = (("x-sim-tokens-per-chunk", "3"),)
    async with channel(vllm_sim) as ch:
        vl = await drain(
            vllm_grpc.VllmEngineStub(ch).Generate(vllm_request(max_tokens=7), metadata=per_chunk)
        )
    async with channel(sglang_sim) as ch:
        sgl = await drain(
            sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_request(max_new_tokens=7), metadata=per_chunk
            )
        )
    expected = output_tokens(PROMPT, 7)
    for messages in (vl, sgl):
        assert [list(m.chunk.token_ids) for m in messages[:-1]] == [
            expected[:3],
            expected[3:6],
            expected[6:],
        ]
        assert list(messages[-1].complete.output_ids) == expected[6:]
    assert [m.chunk.completion_tokens for m in vl[:-1]] == [3, 3, 1]
    assert vl[-1].complete.completion_tokens == 1
    assert [m.chunk.completion_tokens for m in sgl[:-1]] == [3, 6, 7]
    assert sgl[-1].complete.completion_tokens == 7


async def test_a_lying_worker_reports_the_usage_it_is_told(
    sglang_sim: SimProcess, vllm_sim: SimProcess
) -> None:
    """x-sim-completion-tokens: every chunk and Complete says that count, streamed or not,
    whatever was generated (the tokens themselves are the usual ones)."""
    lie = (("x-sim-completion-tokens", str(2**32 - 1)),)
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        vl = await drain(stub.Generate(vllm_request(max_tokens=3), metadata=lie))
        vl_whole = await drain(
            stub.Generate(vllm_request(max_tokens=3, stream=False), metadata=lie)
        )
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        sgl = await drain(stub.Generate(sgl_request(max_new_tokens=3), metadata=lie))
        sgl_whole = await drain(
            stub.Generate(sgl_request(max_new_tokens=3, stream=False), metadata=lie)
        )
    for messages in (vl, vl_whole, sgl, sgl_whole):
        parts = [getattr(m, m.WhichOneof("response")) for m in messages]
        assert [p.completion_tokens for p in parts] == [2**32 - 1] * len(parts)
    assert [list(m.chunk.token_ids) for m in sgl[:-1]] == [[t] for t in output_tokens(PROMPT, 3)]
    assert list(vl_whole[0].complete.output_ids) == output_tokens(PROMPT, 3)


async def test_stop_token_ids_end_the_choice(sglang_sim: SimProcess, vllm_sim: SimProcess) -> None:
    expected = output_tokens(PROMPT, 10)
    stop = expected[2]
    sgl = sgl_request(max_new_tokens=10, stream=False)
    sgl.sampling_params.stop_token_ids.append(stop)
    vl = vllm_request(max_tokens=10, stream=False)
    vl.sampling_params.stop_token_ids.append(stop)
    async with channel(sglang_sim) as ch:
        [sgl_done] = await drain(sgl_grpc.SglangSchedulerStub(ch).Generate(sgl))
    async with channel(vllm_sim) as ch:
        [vl_done] = await drain(vllm_grpc.VllmEngineStub(ch).Generate(vl))
    for done in (sgl_done.complete, vl_done.complete):
        assert list(done.output_ids) == expected[:3]
        assert (done.finish_reason, done.matched_token_id, done.completion_tokens) == (
            "stop",
            stop,
            3,
        )


async def test_output_ends_where_the_context_does(start_sim: StartSim) -> None:
    """A request for 4e9 tokens gets what the context leaves (vLLM: the model length
    less the prompt; SGLang: one short of that, and one more for its own bound), and so
    does one that ignores EOS and sets no maximum."""
    vl = start_sim("--runtime", "vllm", "--max-model-len", "64")
    sgl = start_sim("--max-model-len", "64")
    async with channel(vl) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        [huge] = await drain(stub.Generate(vllm_request(max_tokens=4_000_000_000, stream=False)))
        request = vllm_request(stream=False)
        request.sampling_params.ignore_eos = True
        [endless] = await drain(stub.Generate(request))
    async with channel(sgl) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        [sgl_huge] = await drain(
            stub.Generate(sgl_request(max_new_tokens=4_000_000_000, stream=False))
        )
        request = sgl_request(stream=False)
        request.sampling_params.ignore_eos = True
        [sgl_endless] = await drain(stub.Generate(request))
    for done, count in ((huge, 61), (endless, 61), (sgl_huge, 59), (sgl_endless, 59)):
        assert (done.complete.completion_tokens, done.complete.finish_reason) == (count, "length")
        assert list(done.complete.output_ids) == output_tokens(PROMPT, count)


async def test_a_huge_stream_never_starves_the_loop(start_sim: StartSim, strict: bool) -> None:
    """4e9 tokens asked, no delay between them: the stream yields to the event loop, so
    the worker answers other calls while it streams: each within 0.5 s in the timing
    tier, else their median within ten times that of five asked before and 0.5 s (a
    starved loop would make every one of them late, a busy machine now and then one)."""
    sim = start_sim("--runtime", "vllm", "--max-model-len", "10000000")

    async def timed_loads(stub: Any) -> float:
        started = time.monotonic()
        await stub.GetLoads(vllm_pb2.GetLoadsRequest(), timeout=WAIT_S)
        return time.monotonic() - started

    async with channel(sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        before = statistics.median([await timed_loads(stub) for _ in range(5)])
        call = stub.Generate(vllm_request("big", max_tokens=4_000_000_000), timeout=30)
        await call.read()
        during = [await timed_loads(stub) for _ in range(5)]
        call.cancel()
    assert statistics.median(during) < 10 * before + 0.5, during
    if strict:
        assert max(during) < 0.5, during


async def test_headers_ride_with_the_first_message(sglang_sim: SimProcess) -> None:
    """The servicer never sends Generate's headers on their own: they come with the
    first message, after the time to first token."""
    async with channel(sglang_sim) as ch:
        started = time.monotonic()
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_request(max_new_tokens=2), metadata=(("x-sim-ttft-ms", "300"),), timeout=10
        )
        headers = dict(await call.initial_metadata())
        waited = time.monotonic() - started
        await drain(call)
    assert headers["x-sim-worker"] == "sgl-shared"
    assert waited >= 0.25


async def test_headers_first_sends_them_as_the_call_is_taken(sglang_sim: SimProcess) -> None:
    """`x-sim-headers-first` (`--headers-first`): a test that waits for a call to run
    reads its headers before its first token (two minutes away: no clock to read); with
    a first token that comes, the tokens follow the headers."""
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        waiting = stub.Generate(
            sgl_request(max_new_tokens=2),
            metadata=(("x-sim-ttft-ms", "120000"), ("x-sim-headers-first", "1")),
        )
        headers = dict(await asyncio.wait_for(waiting.initial_metadata(), WAIT_S))
        waiting.cancel()
        await until(lambda: _running_is(stub, 0))
        call = stub.Generate(
            sgl_request(max_new_tokens=2),
            metadata=(("x-sim-ttft-ms", "100"), ("x-sim-headers-first", "1")),
            timeout=WAIT_S,
        )
        messages = await drain(call)
    assert headers["x-sim-running"] == "1"
    assert len(messages) == 3


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


async def _running_is(stub: Any, count: int) -> bool:
    return await running(stub) == count


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


# ------------------------------------------------------------------------------ health


async def _health(ch: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(ch)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


@pytest.mark.sim_processes  # signals
async def test_signals_flip_health_and_sigterm_exits_zero(start_sim: StartSim) -> None:
    sim = start_sim("--runtime", "vllm")
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        (health_pb2.HealthCheckResponse.NOT_SERVING),
    )
    async with channel(sim) as ch:
        engine = vllm_grpc.VllmEngineStub(ch)

        async def state_is(status: int) -> bool:
            return await _health(ch, "") == status and await _health(ch, VLLM_SERVICE) == status

        assert await state_is(serving)
        sim.process.send_signal(signal.SIGUSR1)
        await until(lambda: state_is(not_serving))
        check = await engine.HealthCheck(vllm_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (False, "not serving")
        sim.process.send_signal(signal.SIGUSR2)
        await until(lambda: state_is(serving))
        check = await engine.HealthCheck(vllm_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (True, "Health")  # vLLM's servicer's word
    sim.process.send_signal(signal.SIGTERM)
    assert sim.process.wait(WAIT_S) == 0


async def test_not_serving_and_no_grpc_health(start_sim: StartSim) -> None:
    down = start_sim("--not-serving")
    bare = start_sim("--no-grpc-health")
    async with channel(down) as ch:
        assert await _health(ch, SGL_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await _health(ch, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        check = await sgl_grpc.SglangSchedulerStub(ch).HealthCheck(sgl_pb2.HealthCheckRequest())
        assert not check.healthy
    async with channel(bare) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _health(ch, "")
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        check = await sgl_grpc.SglangSchedulerStub(ch).HealthCheck(sgl_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (True, "Health check passed")


# ------------------------------------------------------------------------- info and admin


async def test_sglang_info_rpcs(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        model = await stub.GetModelInfo(sgl_pb2.GetModelInfoRequest())
        server = await stub.GetServerInfo(sgl_pb2.GetServerInfoRequest())
        loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest())
        rank1 = await stub.GetLoads(sgl_pb2.GetLoadsRequest(dp_rank=1))
        chunks = await drain(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert model.served_model_name == "sim-model"
    assert model.model_path == model.tokenizer_path == "sim/sim-model"
    # The servicer's own figures for what SGLang never tells it: a default vocabulary,
    # no EOS or PAD ids, and the KV pool's size (4,096 blocks of 128) as the context.
    assert model.is_generation and model.max_context_length == 524_288
    assert model.max_req_input_len == 2042  # one short of the context, less 5
    assert model.vocab_size == 128_256 and list(model.eos_token_ids) == []
    assert (model.bos_token_id, model.pad_token_id) == (1, 0)
    assert (model.model_type, list(model.architectures)) == ("llama", ["LlamaForCausalLM"])

    args = dict(server.server_args.items())
    assert args["model_path"] == "sim/sim-model"
    assert args["served_model_name"] == "sim-model"
    assert args["disaggregation_mode"] == "null"
    assert args["disaggregation_bootstrap_port"] == 8998
    assert (args["tp_size"], args["dp_size"]) == (1, 2)
    assert (args["page_size"], args["context_length"], args["max_running_requests"]) == (
        128,
        2048,
        4096,
    )
    assert server.server_type == "grpc" and server.sglang_version == "sim"
    assert server.active_requests == 0

    assert loads.dp_rank_count == 2
    assert [load.dp_rank for load in loads.loads] == [0, 1]
    for load in loads.loads:
        assert load.num_running_reqs == 0 and load.num_waiting_reqs == 0
        # Its prefix cache's size: the default 4,096 blocks of 128 tokens per rank.
        assert load.max_running_requests == 4096 and load.max_total_num_tokens == 524_288
        assert (load.memory.token_capacity, load.disaggregation.mode) == (524_288, "null")
        assert load.HasField("queues")
        assert load.token_usage == 0.0
    assert loads.HasField("aggregate") and loads.aggregate.total_running_reqs == 0
    datetime.fromisoformat(loads.timestamp)
    assert [load.dp_rank for load in rank1.loads] == [1]

    assert len(chunks) == 2
    assert chunks[0].sha256 == ""
    digest = hashlib.sha256(b"".join(c.data for c in chunks)).hexdigest()
    assert chunks[1].sha256 == digest


async def test_vllm_info_rpcs(vllm_sim: SimProcess) -> None:
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        model = await stub.GetModelInfo(vllm_pb2.GetModelInfoRequest())
        server = await stub.GetServerInfo(vllm_pb2.GetServerInfoRequest())
        loads = await stub.GetLoads(vllm_pb2.GetLoadsRequest())
        chunks = await drain(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
        flush = await stub.FlushCache(common_pb2.FlushCacheRequest())
        profile = await stub.StartProfile(common_pb2.StartProfileRequest())
    assert (model.served_model_name, model.model_path) == ("tiny", "sim/tiny")
    assert model.vocab_size == 512 and list(model.eos_token_ids) == [2]
    assert model.max_context_length == model.max_req_input_len == 2048
    assert (model.model_type, model.bos_token_id, model.pad_token_id) == ("llama", 1, 3)
    # The fields the servicer fills from the engine's config, and only those.
    assert (server.block_size, server.kv_cache_dtype, server.model_dtype) == (
        128,
        "auto",
        "torch.float32",
    )
    assert (server.max_num_seqs, server.data_parallel_size) == (128, 1)  # the CPU backend's
    assert (server.multimodal_encoder_dtype, server.constrained_decoding_start) == (
        "float32",
        "first_token",
    )
    assert server.kv_role == server.kv_connector == server.kv_engine_id == ""
    assert server.server_type == "" and server.active_requests == 0
    assert server.uptime_seconds == 0.0 and not server.is_paused
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1 and loads.version == "0.32.0"
    assert loads.loads[0].max_running_requests == 128
    assert len(chunks) == 2 and chunks[1].sha256
    assert flush.success and "vllm-shared" in flush.message
    assert profile.success


async def test_embed_both_runtimes(sglang_sim: SimProcess, vllm_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        sgl = await sgl_grpc.SglangSchedulerStub(ch).Embed(
            sgl_pb2.EmbedRequest(request_id="e", tokenized=sgl_pb2.TokenizedInput(input_ids=PROMPT))
        )
    async with channel(vllm_sim) as ch:
        vl = await vllm_grpc.VllmEngineStub(ch).Embed(
            vllm_pb2.EmbedRequest(
                request_id="e", tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT)
            )
        )
    for response in (sgl, vl):
        assert response.embedding_dim == 8 and response.prompt_tokens == 3
        assert list(response.embedding) == embedding_for(PROMPT)


async def test_admin_lora(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        loaded = await stub.LoadLoRAAdapter(
            sgl_pb2.LoadLoRAAdapterRequest(lora_name="a", lora_path="/l/a", lora_id="id-a")
        )
        listed = await stub.ListLoadedLoRAAdapters(sgl_pb2.ListLoadedLoRAAdaptersRequest())
        unloaded = await stub.UnloadLoRAAdapter(
            sgl_pb2.UnloadLoRAAdapterRequest(lora_name="a", lora_id="id-a")
        )
        again = await stub.UnloadLoRAAdapter(sgl_pb2.UnloadLoRAAdapterRequest(lora_name="a"))
        stop = await stub.StopProfile(common_pb2.StopProfileRequest())
    assert loaded.success and list(loaded.loaded_lora_ids) == ["id-a"]
    assert [(a.lora_id, a.lora_name, a.lora_path) for a in listed.loaded_adapters] == [
        ("id-a", "a", "/l/a")
    ]
    assert unloaded.success and list(unloaded.loaded_lora_ids) == []
    assert not again.success
    assert stop.success


async def test_slow_and_hanging_health_and_reported_load(start_sim: StartSim) -> None:
    slow = start_sim("--health-delay-ms", "300", "--load-waiting", "7", "--load-token-usage", "0.8")
    hung = start_sim("--health-hang")
    request = health_pb2.HealthCheckRequest(service=SGL_SERVICE)
    async with channel(slow) as ch:
        started = time.monotonic()
        reply = await health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started >= 0.3
        loads = await sgl_grpc.SglangSchedulerStub(ch).GetLoads(sgl_pb2.GetLoadsRequest())
        assert loads.loads[0].num_waiting_reqs == 7
        assert loads.loads[0].token_usage == pytest.approx(0.8)
    async with channel(hung) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_pb2_grpc.HealthStub(ch).Check(request, timeout=0.5)
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_vllm_logprobs_and_greedy_n(vllm_sim: SimProcess) -> None:
    """Logprobs as the servicer converts vLLM's: each token's value and its top list;
    the prompt's on the first chunk (streamed) or the Complete (unstreamed), the first
    position without a value. Greedy sampling takes one choice only."""
    streamed = vllm_request(max_tokens=3)
    streamed.sampling_params.logprobs = 2
    streamed.sampling_params.prompt_logprobs = 1
    whole = vllm_request(max_tokens=3, stream=False)
    whole.sampling_params.logprobs = 0
    greedy = vllm_request(max_tokens=3, n=2)
    greedy.sampling_params.temperature = 0.0
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        chunks = await drain(stub.Generate(streamed))
        [done] = await drain(stub.Generate(whole))
        refused, error = await drain_until_error(stub.Generate(greedy))
    first, *rest, final = chunks
    assert list(first.chunk.input_logprobs.token_ids) == PROMPT
    assert [e.HasField("value") for e in first.chunk.input_logprobs.token_logprobs] == [
        False,
        True,
        True,
    ]
    assert [len(t.token_ids) for t in first.chunk.input_logprobs.top_logprobs] == [0, 1, 1]
    assert not any(m.chunk.HasField("input_logprobs") for m in rest)
    for message in (*chunks[:-1], final):
        part = message.chunk if message.WhichOneof("response") == "chunk" else message.complete
        ids = part.token_ids if message.WhichOneof("response") == "chunk" else part.output_ids
        assert list(part.output_logprobs.token_ids) == list(ids)
        [top] = part.output_logprobs.top_logprobs
        assert len(top.token_ids) == 2 and top.token_ids[0] == ids[0]
    assert not final.complete.HasField("input_logprobs")
    assert list(done.complete.output_logprobs.token_ids) == output_tokens(PROMPT, 3)
    assert len(done.complete.output_logprobs.token_logprobs) == 3
    assert not done.complete.output_logprobs.top_logprobs  # logprobs 0: values only
    assert refused == [] and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "n must be 1 when using greedy sampling, got 2."


async def test_grpc_health_names_an_unknown_service(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _health(ch, "no.such.Service")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert error.value.details() == "Unknown service: no.such.Service"
