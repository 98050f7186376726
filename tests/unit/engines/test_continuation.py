"""The engines' side of migration: the continued request (a patch on the client's bytes)
and a continuation's answers rewritten as the client's."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.engines.sglang import SglangAdapter
from gateway.engines.vllm import VllmAdapter
from gateway_sim.client import sgl, vllm

SGLANG, VLLM = SglangAdapter(), VllmAdapter()


def sglang_request(**sampling: Any) -> Any:
    return sgl.GenerateRequest(
        request_id="r1",
        tokenized=sgl.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=sgl.SamplingParams(stop=["x"], temperature=0.5, **sampling),
        stream=True,
    )


def vllm_request(**sampling: Any) -> Any:
    return vllm.GenerateRequest(
        request_id="r1",
        tokenized=vllm.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vllm.SamplingParams(stop=["x"], temperature=0.5, **sampling),
        stream=True,
    )


@pytest.mark.parametrize(
    ("adapter", "request_of", "most", "least"),
    [
        (SGLANG, sglang_request, "max_new_tokens", "min_new_tokens"),
        (VLLM, vllm_request, "max_tokens", "min_tokens"),
    ],
)
@pytest.mark.parametrize(("min_before", "min_after"), [(0, 0), (10, 6), (3, 0)])
def test_the_continuation_appends_the_tokens_and_reduces_the_bounds(
    adapter: Any, request_of: Any, most: str, least: str, min_before: int, min_after: int
) -> None:
    raw = request_of(**{most: 20, least: min_before}).SerializeToString()
    info = adapter.generate_info(raw)
    assert (info.max_new_tokens, info.min_new_tokens, info.unresumable) == (20, min_before, "")
    continued = adapter.continuation(raw, info, [7, 8, 9, 10], "r1~1")
    parsed = adapter.rpcs["Generate"].request_type.FromString(continued)
    assert list(parsed.tokenized.input_ids) == [1, 2, 3, 7, 8, 9, 10]
    assert parsed.request_id == "r1~1"
    assert getattr(parsed.sampling_params, most) == 16
    assert getattr(parsed.sampling_params, least) == min_after
    # Everything else as the client sent it.
    assert list(parsed.sampling_params.stop) == ["x"]
    assert parsed.sampling_params.temperature == pytest.approx(0.5)
    assert parsed.stream


def test_a_request_without_a_maximum_continues_without_one() -> None:
    raw = sglang_request().SerializeToString()
    info = SGLANG.generate_info(raw)
    parsed = sgl.GenerateRequest.FromString(SGLANG.continuation(raw, info, [7], "r1~1"))
    assert not parsed.sampling_params.HasField("max_new_tokens")


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (sglang_request(regex="a+"), "constrained"),
        (sglang_request(json_schema="{}"), "constrained"),
        (sgl.GenerateRequest(tokenized=sgl.TokenizedInput(input_ids=[1]), return_logprob=True),
         "prompt_logprobs"),
        (sgl.GenerateRequest(tokenized=sgl.TokenizedInput(input_ids=[1]), return_logprob=True,
                             logprob_start_len=-1), ""),
        (sgl.GenerateRequest(), "no_token_ids"),
        (vllm_request(grammar="root ::= x"), "constrained"),
        (vllm_request(prompt_logprobs=1), "prompt_logprobs"),
        (vllm_request(logprobs=1), ""),
        (vllm.GenerateRequest(text="hi"), "text_prompt"),
    ],
)  # fmt: skip
def test_why_a_request_cannot_be_resumed(message: Any, reason: str) -> None:
    adapter = SGLANG if isinstance(message, sgl.GenerateRequest) else VLLM
    assert adapter.generate_info(message.SerializeToString()).unresumable == reason


def test_sglang_answers_continue_the_running_totals_under_the_original_id() -> None:
    chunk = sgl.GenerateResponse(
        request_id="r1~1",
        chunk=sgl.GenerateStreamChunk(
            token_ids=[9], prompt_tokens=23, completion_tokens=2, cached_tokens=16
        ),
    ).SerializeToString()
    out = sgl.GenerateResponse.FromString(SGLANG.continued(chunk, 3, 20, "r1"))
    assert out.request_id == "r1"
    assert list(out.chunk.token_ids) == [9]
    assert (out.chunk.prompt_tokens, out.chunk.completion_tokens) == (3, 22)
    assert out.chunk.cached_tokens == 3  # never more than the client's prompt
    complete = sgl.GenerateResponse(
        request_id="r1~1",
        complete=sgl.GenerateComplete(
            output_ids=[9], prompt_tokens=23, completion_tokens=180, finish_reason="length"
        ),
    ).SerializeToString()
    out = sgl.GenerateResponse.FromString(SGLANG.continued(complete, 3, 20, "r1"))
    assert (out.complete.prompt_tokens, out.complete.completion_tokens) == (3, 200)
    assert out.complete.finish_reason == "length"
    assert SGLANG.response_id(chunk) == "r1~1"


def test_vllm_answers_keep_their_deltas() -> None:
    chunk = vllm.GenerateResponse(
        chunk=vllm.GenerateStreamChunk(token_ids=[9, 10], prompt_tokens=23, completion_tokens=2)
    ).SerializeToString()
    out = vllm.GenerateResponse.FromString(VLLM.continued(chunk, 3, 20, ""))
    assert (out.chunk.prompt_tokens, out.chunk.completion_tokens) == (3, 2)
    assert VLLM.response_id(chunk) == ""


def test_relayed_tokens_are_the_chunks_own_and_a_complete_closes() -> None:
    chunks = [
        sgl.GenerateResponse(request_id="r1", chunk=sgl.GenerateStreamChunk(
            token_ids=ids, completion_tokens=total)).SerializeToString()
        for ids, total in (([4, 5], 2), ([6], 3), ([], 3), ([7], 4))
    ]  # fmt: skip
    complete = sgl.GenerateResponse(complete=sgl.GenerateComplete(output_ids=[7]))
    ids, closing = SGLANG.relayed(b"".join(chunks))
    assert (list(ids), closing) == ([4, 5, 6, 7], False)
    ids, closing = SGLANG.relayed(b"".join([*chunks, complete.SerializeToString()]))
    assert (list(ids), closing) == ([], True)
    vllm_chunks = [
        vllm.GenerateResponse(chunk=vllm.GenerateStreamChunk(token_ids=[i])).SerializeToString()
        for i in (1, 2, 3)
    ]
    assert list(VLLM.relayed(b"".join(vllm_chunks))[0]) == [1, 2, 3]
