"""The calls of the worker contract, as data, one list per engine: what
tests/contract/record.py sends a real gRPC worker (smg-grpc-servicer's VllmEngine or
SglangScheduler) to record its answers, and what tests/contract/test_transcripts.py sends
the simulator to compare its answers with them.

The worker serves the tiny random-weight Llama of scripts/engines/make_model.py: context
2048, vocabulary 512 (ids 0-3 are <unk>, <s>, </s>, <pad>). Its KV cache: blocks of 128
tokens under vLLM (its CPU backend), pages of 1 token under SGLang (its radix cache).
Sampling is greedy (temperature 0; vLLM's with a seed), so the real worker's token ids
are the same on every run; the simulator's are its own (see compare.py for what is
compared and what is not).

Metadata `x-sim-*` steers the simulator only (a real worker ignores it): a first token
late enough to tell headers sent ahead of it from headers sent with it, and a call slow
enough to abort while it runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MODEL = "tiny"
MAX_MODEL_LEN = 2048
VOCAB_SIZE = 512
BLOCK_SIZE = 128
SEED = 7
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
SGLANG_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
HEALTH = "grpc.health.v1.Health"
FIRST_WORD = 4  # ids below are the specials

# Where a call goes: the contract's one worker, or a leg of its prefill/decode pair (PAIR:
# the same request to both at once, as SGLang's PD is run).
WORKER, PREFILL, DECODE, PAIR = "worker", "prefill", "decode", "pair"

# Checks beyond the ones every call gets (compare.py):
DETAILS = "details"  # the status message text, exactly (validation errors)
HEADER_TIMING = "header_timing"  # whether headers came ahead of the first message


def prompt(length: int, salt: int) -> list[int]:
    """`length` token ids of the vocabulary's words (no specials); another `salt`, another
    prompt (no shared prefix, so no call reuses another's KV blocks)."""
    words = VOCAB_SIZE - FIRST_WORD
    return [FIRST_WORD + (salt * 131 + i * 37 + (i * i) % 7) % words for i in range(length)]


def sampling(**fields: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "seed": SEED, **fields}


def request(
    request_id: str, input_ids: list[int], stream: bool, params: Mapping[str, Any], **top: Any
) -> dict[str, Any]:
    """A GenerateRequest of either engine (both name these fields alike)."""
    return {
        "request_id": request_id,
        "tokenized": {"input_ids": input_ids},
        "sampling_params": dict(params),
        "stream": stream,
        **top,
    }


def generate(request_id: str, input_ids: list[int], stream: bool, **params: Any) -> dict[str, Any]:
    """vLLM's: greedy and seeded."""
    return request(request_id, input_ids, stream, sampling(**params))


def sgl_generate(
    request_id: str,
    input_ids: list[int],
    stream: bool,
    top: Mapping[str, Any] | None = None,
    **params: Any,
) -> dict[str, Any]:
    """SGLang's: greedy (its SamplingParams has no seed); `top` holds the request's own
    fields (logprobs are asked there, not in the sampling parameters)."""
    return request(request_id, input_ids, stream, {"temperature": 0.0, **params}, **(top or {}))


@dataclass(frozen=True)
class Call:
    """One RPC: `method` is `Service/Method` (the engine's when no service is named), its
    request in protobuf's JSON form (proto field names), or `raw` bytes sent as the
    request instead (one that does not decode). `timeout_s` is the call's deadline.

    In a prefill/decode contract, `leg` is the worker it goes to; what a router adds to a
    leg's request is added when it is sent: `kv_from` (vLLM's decode) names the earlier
    prefill call whose Complete's kv_transfer_params it carries, `bootstrap_room`
    (SGLang's pair) the room it names beside the prefill's bootstrap host and port."""

    name: str
    method: str
    request: Mapping[str, Any] = field(default_factory=dict)
    raw: bytes | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    checks: frozenset[str] = frozenset()
    # Abort the call's request_id (a second RPC) once this many messages arrived, then
    # read the stream to its end.
    abort_after: int | None = None
    timeout_s: float = 60.0
    note: str = ""
    leg: str = WORKER
    kv_from: str | None = None
    bootstrap_room: int | None = None

    def full_method(self, engine_service: str) -> str:
        service, _, rpc = self.method.rpartition("/")
        return f"/{service or engine_service}/{rpc}"


@dataclass(frozen=True)
class KvRestart:
    """SubscribeKvEvents across a worker restart, in one scenario:

    1. subscribe from 0 (`load_records_before_first_batch`, as the gateway does) and
       listen while the worker idles (`idle_units`);
    2. a Generate whose prompt fills `prompt_blocks` KV blocks; listen on (`after_units`)
       for the batch of stored blocks, the load records that follow and their cadence;
    3. subscribe from 1, and from the sequence number after the last one seen (a resume);
    4. kill -9 the worker and start it again (same port, same KV events endpoint): how
       the first subscription ends;
    5. subscribe from 0 again and send the same Generate: the sequence numbers after a
       restart.

    Windows are in units of the worker's load-record heartbeat (`unit_s`): 1 s for the
    real servicer, shorter for a simulator told so."""

    name: str = "kv_events_across_restart"
    prompt_blocks: int = 2
    prompt_extra: int = 44  # tokens past the last full block (not stored)
    idle_units: float = 3.0
    after_units: float = 11.0
    after_restart_units: float = 3.0
    salt: int = 90

    def generate_request(self, request_id: str) -> dict[str, Any]:
        ids = prompt(self.prompt_blocks * BLOCK_SIZE + self.prompt_extra, self.salt)
        return generate(request_id, ids, stream=False, max_tokens=4)


SLOW_FIRST_TOKEN = (("x-sim-ttft-ms", "400"),)
LONG = 1500  # 11 full blocks and 92 tokens


def info_calls(service: str) -> tuple[Call, ...]:
    """Health and the worker's descriptions: every engine's first calls."""
    return (
        Call("health_check", "HealthCheck"),
        Call("grpc_health_overall", f"{HEALTH}/Check", {"service": ""}),
        Call("grpc_health_engine", f"{HEALTH}/Check", {"service": service}),
        Call(
            "grpc_health_unknown",
            f"{HEALTH}/Check",
            {"service": "no.such.Service"},
            checks=frozenset({DETAILS}),
        ),
        Call("get_model_info", "GetModelInfo"),
        Call("get_server_info", "GetServerInfo"),
        Call("get_loads", "GetLoads"),
    )


UNDECODABLE = Call(
    "generate_undecodable",
    "Generate",
    raw=b"\x0a\xff\xff\xff\xff\x0f",  # field 1 (request_id) with a length past the end
    checks=frozenset({DETAILS}),
)

VLLM_CALLS: tuple[Call, ...] = (
    *info_calls(VLLM_SERVICE),
    Call(
        "generate_stream",
        "Generate",
        generate("generate_stream", prompt(8, 1), stream=True, max_tokens=8),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_unary",
        "Generate",
        generate("generate_unary", prompt(8, 2), stream=False, max_tokens=8),
    ),
    Call(
        "generate_stream_n2",
        "Generate",
        generate(
            "generate_stream_n2", prompt(8, 3), stream=True, max_tokens=6, n=2, temperature=1.0
        ),
        note="sampled (temperature 1, seeded): vLLM refuses n > 1 under greedy sampling",
    ),
    Call(
        "generate_unary_n2",
        "Generate",
        generate(
            "generate_unary_n2", prompt(8, 4), stream=False, max_tokens=6, n=2, temperature=1.0
        ),
    ),
    Call(
        "generate_n2_greedy",
        "Generate",
        generate("generate_n2_greedy", prompt(8, 16), stream=True, max_tokens=6, n=2),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_n0",
        "Generate",
        generate("generate_n0", prompt(8, 5), stream=True, max_tokens=3, n=0),
        note="n is a plain proto3 field: 0 is the same as unset",
    ),
    Call(
        "generate_stop_token_ids",
        "Generate",
        # Every word is a stop token: the first generated one stops the call, whichever
        # it is (the simulator's ids are not the model's).
        generate(
            "generate_stop_token_ids",
            prompt(8, 6),
            stream=True,
            max_tokens=8,
            stop_token_ids=list(range(FIRST_WORD, VOCAB_SIZE)),
        ),
    ),
    Call(
        "generate_stop_token_ids_unary",
        "Generate",
        generate(
            "generate_stop_token_ids_unary",
            prompt(8, 7),
            stream=False,
            max_tokens=8,
            stop_token_ids=list(range(FIRST_WORD, VOCAB_SIZE)),
        ),
    ),
    Call(
        "generate_logprobs_stream",
        "Generate",
        generate(
            "generate_logprobs_stream",
            prompt(6, 8),
            stream=True,
            max_tokens=4,
            logprobs=2,
            prompt_logprobs=1,
        ),
    ),
    Call(
        "generate_logprobs_unary",
        "Generate",
        generate(
            "generate_logprobs_unary",
            prompt(6, 9),
            stream=False,
            max_tokens=4,
            logprobs=2,
            prompt_logprobs=1,
        ),
    ),
    Call(
        "generate_long_prompt",
        "Generate",
        generate("generate_long_prompt", prompt(LONG, 10), stream=True, max_tokens=2),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_long_prompt_cached",
        "Generate",
        generate("generate_long_prompt_cached", prompt(LONG, 10), stream=True, max_tokens=2),
        note="the same prompt again: its full blocks come from the prefix cache",
    ),
    Call(
        "generate_max_tokens_past_context",
        "Generate",
        generate(
            "generate_max_tokens_past_context",
            prompt(MAX_MODEL_LEN - 8, 11),
            stream=True,
            max_tokens=100,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_fills_context",
        "Generate",
        generate(
            "generate_prompt_fills_context", prompt(MAX_MODEL_LEN, 12), stream=True, max_tokens=1
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_over_context",
        "Generate",
        generate(
            "generate_prompt_over_context", prompt(MAX_MODEL_LEN + 1, 13), stream=True, max_tokens=1
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_empty_prompt",
        "Generate",
        generate("generate_empty_prompt", [], stream=True, max_tokens=4),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_out_of_vocabulary",
        "Generate",
        generate("generate_out_of_vocabulary", [5, VOCAB_SIZE + 88, 7], stream=True, max_tokens=4),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_max_tokens_zero",
        "Generate",
        generate("generate_max_tokens_zero", prompt(8, 14), stream=True, max_tokens=0),
        checks=frozenset({DETAILS}),
    ),
    UNDECODABLE,
    Call(
        "abort_running",
        "Generate",
        generate("abort_running", prompt(8, 15), stream=True, max_tokens=1000),
        metadata=(("x-sim-token-ms", "20"),),
        abort_after=2,
    ),
    Call("abort_unknown", "Abort", {"request_ids": ["no-such-request"]}),
)

KV_RESTART = KvRestart()

SGLANG_PAGE_SIZE = 1  # its radix cache: a prefix is cached to the token
SGLANG_LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
ALL_WORDS_STOP = list(range(FIRST_WORD, VOCAB_SIZE))

# SGLang's equivalents of the vLLM calls. Left out: an empty prompt and an out-of-vocabulary
# id, each of which kills a real SGLang worker (docs/real-engines.md), and the KV events
# scenario (no SubscribeKvEvents without --kv-events-config: one plain call shows it).
SGLANG_CALLS: tuple[Call, ...] = (
    *info_calls(SGLANG_SERVICE),
    Call(
        "generate_stream",
        "Generate",
        sgl_generate("generate_stream", prompt(8, 1), stream=True, max_new_tokens=8),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_unary",
        "Generate",
        sgl_generate("generate_unary", prompt(8, 2), stream=False, max_new_tokens=8),
    ),
    Call(
        "generate_stream_n2",
        "Generate",
        sgl_generate("generate_stream_n2", prompt(8, 3), stream=True, max_new_tokens=6, n=2),
        note="greedy: SGLang takes n > 1 under greedy sampling (vLLM refuses it)",
    ),
    Call(
        "generate_unary_n2",
        "Generate",
        sgl_generate("generate_unary_n2", prompt(8, 4), stream=False, max_new_tokens=6, n=2),
    ),
    Call(
        "generate_n0",
        "Generate",
        sgl_generate("generate_n0", prompt(8, 5), stream=True, max_new_tokens=3, n=0),
        note="n is a plain proto3 field: 0 is the same as unset",
    ),
    Call(
        "generate_stop_token_ids",
        "Generate",
        sgl_generate(
            "generate_stop_token_ids",
            prompt(8, 6),
            stream=True,
            max_new_tokens=8,
            stop_token_ids=ALL_WORDS_STOP,
        ),
    ),
    Call(
        "generate_stop_token_ids_unary",
        "Generate",
        sgl_generate(
            "generate_stop_token_ids_unary",
            prompt(8, 7),
            stream=False,
            max_new_tokens=8,
            stop_token_ids=ALL_WORDS_STOP,
        ),
    ),
    Call(
        "generate_logprobs_stream",
        "Generate",
        sgl_generate(
            "generate_logprobs_stream", prompt(6, 8), True, SGLANG_LOGPROBS, max_new_tokens=4
        ),
    ),
    Call(
        "generate_logprobs_unary",
        "Generate",
        sgl_generate(
            "generate_logprobs_unary", prompt(6, 9), False, SGLANG_LOGPROBS, max_new_tokens=4
        ),
    ),
    Call(
        "generate_long_prompt",
        "Generate",
        sgl_generate("generate_long_prompt", prompt(LONG, 10), stream=True, max_new_tokens=2),
        metadata=SLOW_FIRST_TOKEN,
        checks=frozenset({HEADER_TIMING}),
    ),
    Call(
        "generate_long_prompt_cached",
        "Generate",
        sgl_generate(
            "generate_long_prompt_cached", prompt(LONG, 10), stream=True, max_new_tokens=2
        ),
        note="the same prompt again: all but its last token come from the radix cache",
    ),
    Call(
        "generate_max_tokens_past_context",
        "Generate",
        sgl_generate(
            "generate_max_tokens_past_context",
            prompt(MAX_MODEL_LEN - 8, 11),
            stream=True,
            max_new_tokens=100,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_fills_context",
        "Generate",
        sgl_generate(
            "generate_prompt_fills_context",
            prompt(MAX_MODEL_LEN, 12),
            stream=True,
            max_new_tokens=1,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_prompt_over_context",
        "Generate",
        sgl_generate(
            "generate_prompt_over_context",
            prompt(MAX_MODEL_LEN + 1, 13),
            stream=True,
            max_new_tokens=1,
        ),
        checks=frozenset({DETAILS}),
    ),
    Call(
        "generate_max_tokens_zero",
        "Generate",
        sgl_generate("generate_max_tokens_zero", prompt(8, 14), stream=True, max_new_tokens=0),
        checks=frozenset({DETAILS}),
    ),
    UNDECODABLE,
    Call(
        "abort_running",
        "Generate",
        sgl_generate("abort_running", prompt(8, 15), stream=True, max_new_tokens=1000),
        metadata=(("x-sim-token-ms", "20"),),
        abort_after=2,
        timeout_s=5.0,
        note="SGLang stops the request but its stream never ends: the deadline ends it",
    ),
    Call("abort_unknown", "Abort", {"request_id": "no-such-request"}),
    Call(
        "subscribe_kv_events",
        "SubscribeKvEvents",
        {"start_sequence_number": 0, "load_records_before_first_batch": True},
        checks=frozenset({DETAILS}),
        timeout_s=5.0,
    ),
)


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


@dataclass(frozen=True)
class Contract:
    """One contract: its engine's service, its calls, the form of its Abort, its KV
    scenario (None: left out), its workers (one, or a prefill and a decode) and the
    transcript of real workers' answers."""

    name: str
    engine: str  # as `gateway sim --runtime` names it
    service: str
    calls: tuple[Call, ...]
    transcript: str  # a file in tests/contract/transcripts
    block_size: int  # the KV cache's block (vLLM) or page (SGLang), in tokens
    abort: Callable[[str], dict[str, Any]]
    kv: KvRestart | None = None
    legs: tuple[str, ...] = (WORKER,)

    def call(self, name: str) -> Call | None:
        return next((call for call in self.calls if call.name == name), None)

    @property
    def names(self) -> list[str]:
        """Every entry of its transcript."""
        return [call.name for call in self.calls] + ([self.kv.name] if self.kv else [])


VLLM = Contract(
    name="vllm",
    engine="vllm",
    service=VLLM_SERVICE,
    calls=VLLM_CALLS,
    transcript="vllm-0.32.0.json",
    block_size=BLOCK_SIZE,
    abort=lambda request_id: {"request_ids": [request_id]},
    kv=KV_RESTART,
)
SGLANG = Contract(
    name="sglang",
    engine="sglang",
    service=SGLANG_SERVICE,
    calls=SGLANG_CALLS,
    transcript="sglang-0.5.23.json",
    block_size=SGLANG_PAGE_SIZE,
    abort=lambda request_id: {"request_id": request_id},
)
VLLM_PD = Contract(
    name="vllm-pd",
    engine="vllm",
    service=VLLM_SERVICE,
    calls=VLLM_PD_CALLS,
    transcript="vllm-pd-0.32.0.json",
    block_size=BLOCK_SIZE,
    abort=VLLM.abort,
    legs=(PREFILL, DECODE),
)
SGLANG_PD = Contract(
    name="sglang-pd",
    engine="sglang",
    service=SGLANG_SERVICE,
    calls=SGLANG_PD_CALLS,
    transcript="sglang-pd-0.5.23.json",
    block_size=SGLANG_PAGE_SIZE,
    abort=SGLANG.abort,
    legs=(PREFILL, DECODE),
)
CONTRACTS: dict[str, Contract] = {
    contract.name: contract for contract in (VLLM, SGLANG, VLLM_PD, SGLANG_PD)
}
