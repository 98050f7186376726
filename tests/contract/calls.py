"""The calls of the worker contract, as data: what tests/contract/record.py sends a real gRPC
worker (smg-grpc-servicer's VllmEngine or SglangScheduler) to record its answers, and what
tests/contract/test_transcripts.py sends the simulator to compare its answers with them.
This module: what a call and a contract are, and how their requests are built; the lists,
one per engine: calls_vllm.py, calls_sglang.py, calls_pd.py (the prefill/decode pairs);
the contracts themselves: contracts.py.

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
