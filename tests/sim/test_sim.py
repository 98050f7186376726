"""End-to-end tests of the simulated worker's Generate, spoken to over real protos (hosted, or
a real process where the test is about the process: see tests/sim/conftest.py): SGLang and
vLLM streams and single answers, n choices, tokens per chunk, the usage it is told to
report, stop tokens and the context's end, a huge stream, and when its headers go."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim.model import output_tokens
from tests.sim.conftest import SimProcess
from tests.support.sim import StartSim
from tests.support.sim_calls import PROMPT, _running_is, channel, drain, sgl_request, vllm_request
from tests.support.waits import WAIT_S, until

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
