"""Usage is counted the engine's way: vLLM streams deltas (a chunk counts its own tokens, a
streamed Complete repeats the last chunk), its unstreamed Complete and SGLang's answers carry
totals. Built from the messages the real servicers send (smg-grpc-servicer 0.14.1)."""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.engines.usage import Counting, UsageBounds

VLLM = engine_adapters()[Runtime.VLLM]
SGLANG = engine_adapters()[Runtime.SGLANG]


def vllm_chunk(tokens: list[int], index: int = 0, cached: int = 0) -> bytes:
    chunk = vllm.GenerateStreamChunk(
        token_ids=tokens, completion_tokens=len(tokens), cached_tokens=cached, index=index
    )
    return bytes(vllm.GenerateResponse(chunk=chunk).SerializeToString())


def vllm_complete(tokens: list[int], index: int = 0, cached: int = 0) -> bytes:
    complete = vllm.GenerateComplete(
        output_ids=tokens,
        completion_tokens=len(tokens),
        cached_tokens=cached,
        index=index,
        finish_reason="length",
    )
    return bytes(vllm.GenerateResponse(complete=complete).SerializeToString())


def counted(adapter: Any, stream: bool, choices: int, messages: list[bytes]) -> tuple[int, int]:
    tally = adapter.tally(stream, choices)
    for message in messages:
        tally.see(message)
    return tally.completion_tokens, tally.cached_tokens


def test_a_vllm_stream_counts_every_chunk_and_not_the_complete_again() -> None:
    # 150 tokens: one per chunk, then three at once (a reader that lagged), the last one
    # repeated by the Complete, as vLLM's delta mode sends them.
    messages = [vllm_chunk([7], cached=32) for _ in range(146)]
    messages += [vllm_chunk([7, 8, 9], cached=32), vllm_chunk([5], cached=32)]
    messages.append(vllm_complete([5], cached=32))
    assert VLLM.counting(True) is Counting.DELTAS
    assert counted(VLLM, True, 1, messages) == (150, 32)


def test_vllm_choices_interleave_each_with_its_own_deltas() -> None:
    messages = [
        vllm_chunk([1], index=0),
        vllm_chunk([2, 3], index=1),
        vllm_chunk([4], index=0),
        vllm_complete([4], index=0),
        vllm_chunk([5], index=1),
        vllm_complete([5], index=1),
    ]
    assert counted(VLLM, True, 2, messages) == (5, 0)


def test_an_unstreamed_vllm_complete_has_all_of_its_choice() -> None:
    assert VLLM.counting(False) is Counting.TOTALS
    messages = [vllm_complete([1, 2, 3], index=0), vllm_complete([4, 5], index=1)]
    assert counted(VLLM, False, 2, messages) == (5, 0)


def test_sglang_chunks_carry_running_totals_and_a_cut_stream_counts_what_came() -> None:
    def chunk(total: int) -> bytes:
        part = sgl.GenerateStreamChunk(token_ids=[1], completion_tokens=total, cached_tokens=16)
        return bytes(sgl.GenerateResponse(request_id="r", chunk=part).SerializeToString())

    done = sgl.GenerateComplete(output_ids=[1], completion_tokens=5, cached_tokens=16)
    complete = sgl.GenerateResponse(request_id="r", complete=done).SerializeToString()
    assert SGLANG.counting(True) is Counting.TOTALS
    assert counted(SGLANG, True, 1, [chunk(k) for k in range(1, 6)] + [complete]) == (5, 16)
    assert counted(SGLANG, True, 1, [chunk(k) for k in range(1, 4)]) == (3, 16)


def test_sglang_unstreamed_choices_that_all_say_index_0_each_count() -> None:
    def complete(tokens: int) -> bytes:
        done = sgl.GenerateComplete(output_ids=[1] * tokens, completion_tokens=tokens, index=0)
        return bytes(sgl.GenerateResponse(request_id="r", complete=done).SerializeToString())

    assert counted(SGLANG, False, 2, [complete(4), complete(6)]) == (10, 0)


def test_a_workers_stray_choice_index_does_not_grow_the_tally() -> None:
    tally = VLLM.tally(True, 2)
    for index in (0, 1, 7, 2**32 - 1, 1):
        tally.see(vllm_chunk([1, 2], index=index))
    assert tally.completion_tokens == 10
    assert len(tally._tokens) == 2


def test_a_workers_usage_past_what_the_call_could_use_counts_as_the_bound() -> None:
    # A worker is untrusted: 2^32-1 completion tokens for a call that may generate 2 x 64
    # counts as 128 (it settles the tenant's token budget), and is named as rejected.
    bounds = UsageBounds(completion_tokens=2 * 64, cached_tokens=100)
    tally = VLLM.tally(True, 2, bounds)
    tally.see(vllm_chunk([1] * 3, index=0, cached=50))
    assert (tally.completion_tokens, tally.cached_tokens, tally.rejected) == (3, 50, ())
    huge = vllm.GenerateStreamChunk(completion_tokens=2**32 - 1, cached_tokens=2**32 - 1)
    tally.see(bytes(vllm.GenerateResponse(chunk=huge).SerializeToString()))
    assert (tally.completion_tokens, tally.cached_tokens) == (128, 100)
    assert tally.rejected == ("completion_tokens", "cached_tokens")
