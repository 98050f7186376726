"""What the in-process disaggregation tests share (tests/component/test_disagg*.py): the
SGLang and vLLM requests they send, a gateway's address, the tokens of a stream, and the
Generate request lines the gateway logged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway_sim.client import sgl, vllm
from tests.support.waits import until

PROMPT = [1, 2, 3]


def sgl_request(
    request_id: str, tokens: int = 4, stream: bool = True, n: int = 1, **extra: Any
) -> Any:
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=PROMPT),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens, n=n),
        stream=stream,
        **extra,
    )


def vllm_request(request_id: str, tokens: int = 4, stream: bool = True) -> Any:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm.SamplingParams(max_tokens=tokens),
        stream=stream,
    )


def address(gw: Any) -> str:
    return f"127.0.0.1:{gw.port}"


def tokens_of(messages: list[Any]) -> list[int]:
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]


def requests(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [e for e in logs if e.get("event") == "request" and e.get("rpc") == "Generate"]


async def logged(logs: Sequence[Mapping[str, Any]], count: int) -> list[Mapping[str, Any]]:
    """The Generate request events once `count` are logged (the line follows the reply)."""
    await until(lambda: len(requests(logs)) >= count)
    return requests(logs)
