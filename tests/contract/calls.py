"""The calls of the vLLM worker contract, as data: what scripts/record_transcripts.py sends
a real vLLM gRPC worker (smg-grpc-servicer's VllmEngine) to record its answers, and what
tests/contract/test_transcripts.py sends the simulator to compare its answers with them.

The worker serves the tiny random-weight Llama of scripts/engines/make_model.py: context
2048, vocabulary 512 (ids 0-3 are <unk>, <s>, </s>, <pad>), KV blocks of 128 tokens (vLLM's
CPU backend). Sampling is greedy (temperature 0) with a seed, so the real worker's token
ids are the same on every run; the simulator's are its own (see compare.py for what is
compared and what is not).

Metadata `x-sim-*` steers the simulator only (a real worker ignores it): a first token
late enough to tell headers sent ahead of it from headers sent with it, and a call slow
enough to abort while it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODEL = "tiny"
MAX_MODEL_LEN = 2048
VOCAB_SIZE = 512
BLOCK_SIZE = 128
SEED = 7
ENGINE = "vllm.grpc.engine.VllmEngine"
HEALTH = "grpc.health.v1.Health"
FIRST_WORD = 4  # ids below are the specials

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


def generate(request_id: str, input_ids: list[int], stream: bool, **params: Any) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "tokenized": {"input_ids": input_ids},
        "sampling_params": sampling(**params),
        "stream": stream,
    }


@dataclass(frozen=True)
class Call:
    """One RPC: `method` is `Service/Method` (the engine's when no service is named), its
    request in protobuf's JSON form (proto field names), or `raw` bytes sent as the
    request instead (one that does not decode)."""

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

    @property
    def full_method(self) -> str:
        service, _, rpc = self.method.rpartition("/")
        return f"/{service or ENGINE}/{rpc}"


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

CALLS: tuple[Call, ...] = (
    Call("health_check", "HealthCheck"),
    Call("grpc_health_overall", f"{HEALTH}/Check", {"service": ""}),
    Call("grpc_health_engine", f"{HEALTH}/Check", {"service": ENGINE}),
    Call(
        "grpc_health_unknown",
        f"{HEALTH}/Check",
        {"service": "no.such.Service"},
        checks=frozenset({DETAILS}),
    ),
    Call("get_model_info", "GetModelInfo"),
    Call("get_server_info", "GetServerInfo"),
    Call("get_loads", "GetLoads"),
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
    Call(
        "generate_undecodable",
        "Generate",
        raw=b"\x0a\xff\xff\xff\xff\x0f",  # field 1 (request_id) with a length past the end
        checks=frozenset({DETAILS}),
    ),
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
