"""The prefill/decode pairs' contract calls, as data (calls.py says what a call is): each
leg's description, loads and health before and after, and a call handed from prefill to
decode, streamed and unary (vLLM: two calls, the decode given the prefill's
kv_transfer_params; SGLang: one request to both legs at once, naming a room)."""

from __future__ import annotations

import json
from typing import Any

from tests.contract.calls import (
    DECODE,
    PAIR,
    PREFILL,
    Call,
    generate,
    prompt,
    request,
    sampling,
    sgl_generate,
)
from tests.contract.calls_sglang import SGLANG_LOGPROBS

# A prefill/decode pair, as a router drives it: the legs' descriptions (their roles, the
# prefill's bootstrap port), a call handed from prefill to decode streamed and unary, the
# legs' loads and health after. The prompts span a full KV block and part of the next.
PD_PROMPT = 200
VLLM_PREFILL_KV = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})


def leg_calls(when: str, *rpcs: str) -> tuple[Call, ...]:
    """Each of `rpcs` (unary, empty request) to each leg: `prefill_<rpc>_<when>`, ..."""
    return tuple(
        Call(f"{leg}_{snake(rpc)}_{when}", rpc, leg=leg)
        for rpc in rpcs
        for leg in (PREFILL, DECODE)
    )


def snake(rpc: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in rpc).lstrip("_")


def vllm_prefill(request_id: str, salt: int) -> Call:
    """vLLM's first leg, as the gateway sends it: one token, unary, for a remote decode."""
    body = request(
        request_id,
        prompt(PD_PROMPT, salt),
        False,
        sampling(max_tokens=1),
        kv_transfer_params_json=VLLM_PREFILL_KV,
    )
    return Call(request_id, "Generate", body, leg=PREFILL)


def vllm_decode(request_id: str, salt: int, stream: bool, prefill: str) -> Call:
    """vLLM's second leg: the client's request with the prefill's kv_transfer_params."""
    body = generate(request_id, prompt(PD_PROMPT, salt), stream=stream, max_tokens=8)
    return Call(request_id, "Generate", body, leg=DECODE, kv_from=prefill)


VLLM_PD_CALLS: tuple[Call, ...] = (
    *leg_calls("before", "GetServerInfo", "HealthCheck"),
    vllm_prefill("prefill_generate", 20),
    vllm_decode("decode_generate_stream", 20, True, "prefill_generate"),
    vllm_prefill("prefill_generate_2", 21),
    vllm_decode("decode_generate_unary", 21, False, "prefill_generate_2"),
    *leg_calls("after", "GetLoads", "HealthCheck"),
)


def sglang_pair(request_id: str, salt: int, stream: bool, room: int, **top: Any) -> Call:
    """SGLang's pair: the same request, naming the prefill's bootstrap and a room, to both
    legs at once."""
    body = sgl_generate(request_id, prompt(PD_PROMPT, salt), stream, top, max_new_tokens=8)
    return Call(request_id, "Generate", body, leg=PAIR, bootstrap_room=room)


SGLANG_PD_CALLS: tuple[Call, ...] = (
    *leg_calls("before", "GetServerInfo", "HealthCheck"),
    sglang_pair("pair_generate_stream", 20, True, 1001),
    sglang_pair("pair_generate_unary", 21, False, 1002),
    sglang_pair("pair_generate_logprobs", 22, True, 1003, **SGLANG_LOGPROBS),
    *leg_calls("after", "GetLoads", "HealthCheck"),
)
