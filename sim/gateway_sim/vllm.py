"""The simulated vLLM engine: ``vllm.grpc.engine.VllmEngine``, answering as
smg-grpc-servicer 0.14.1's vLLM servicer does over vLLM 0.32 (the CPU backend).

- Generate streams deltas (``RequestOutputKind.DELTA``): each chunk carries its own
  tokens and counts them; a choice's Complete follows its last chunk and repeats that
  chunk's tokens only. Unstreamed, one Complete per choice holds them all.
- Requests are refused with vLLM's own words (INVALID_ARGUMENT): ``max_tokens`` below
  1, an empty prompt, one that leaves no room in the context, a token id outside the
  vocabulary. Output stops where the context ends (``length``).
- GetServerInfo and GetModelInfo fill the fields the servicer fills, from the engine's
  config; nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from grpc.aio import ServicerContext
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim.config import SimConfig
from gateway_sim.dialect import Dialect, Refused
from gateway_sim.plan import Sampling
from gateway_sim.shared import SharedRpcs

SERVICE_NAME: str = vllm_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name

# The tiny Llama as the real-engine tests serve it (`--dtype float32`; vLLM's CPU backend
# would downcast an unset dtype to bfloat16), its KV cache in the model's dtype.
MODEL_DTYPE = "torch.float32"
KV_CACHE_DTYPE = "auto"
# Where the engine starts a request's grammar (no reasoning parser: at once).
CONSTRAINED_DECODING_START = "first_token"
VLLM_VERSION = "0.32.0"
# Below this a temperature samples greedily.
_SAMPLING_EPS = 1e-5


class VllmDialect(Dialect):
    """vLLM's Generate answers and checks (vllm/v1/engine/input_processor.py,
    vllm/sampling_params.py, renderers/base.py)."""

    chunk_counts_total = False
    complete_counts_total = False
    names_eos = False
    indexes_unstreamed = True
    prefix_pass = False
    max_running_requests = 128  # max_num_seqs: the CPU backend's default for a server
    health_message = "Health"

    def check(self, config: SimConfig, input_ids: Sequence[int] | None, sampling: Sampling) -> None:
        input_ids = input_ids or ()
        if sampling.max_tokens is not None and sampling.max_tokens < 1:
            raise Refused(
                f"max_tokens must be at least 1, got {sampling.max_tokens}. "
                f"(parameter=max_tokens, value={sampling.max_tokens})"
            )
        greedy = sampling.temperature is not None and sampling.temperature < _SAMPLING_EPS
        if greedy and sampling.choices > 1:
            raise Refused(f"n must be 1 when using greedy sampling, got {sampling.choices}.")
        length, limit = len(input_ids), config.max_model_len
        if length == 0:
            raise Refused("The decoder prompt cannot be empty")
        if length > limit:
            raise Refused(
                f"The decoder prompt (length {length}) is longer than the maximum model "
                f"length of {limit}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens."
            )
        if length == limit:
            raise Refused(
                f"The decoder prompt (length {length}) plus the number of requested output "
                f"tokens (at least 1) is longer than the maximum model length of {limit}. "
                "Make sure that `max_model_len` is no smaller than the number of text "
                "tokens (prompt + requested output tokens)."
            )
        highest = max(input_ids)
        if highest > config.vocab_size - 1:
            raise Refused(f"Token id {highest} is out of vocabulary")

    def room(self, config: SimConfig, kv_tokens: int, prompt_tokens: int) -> int:
        return config.max_model_len - prompt_tokens


DIALECT = VllmDialect(vllm_pb2, with_request_id=False)


def input_ids_of(request: Any) -> Any:
    """The prompt's token ids; text prompts have no tokenizer here: one "token" per
    UTF-8 byte."""
    if request.WhichOneof("input") == "text":
        return list(request.text.encode())
    return request.tokenized.input_ids


def sampling_of(request: Any) -> Sampling:
    params = request.sampling_params
    return Sampling(
        n=params.n,
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        stream=request.stream,
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        temperature=params.temperature if params.HasField("temperature") else None,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
    )


def shm_namespace_id() -> str:
    """This host's ``/dev/shm`` identity (boot id and the tmpfs's device), as the
    servicer reports it for its shared-memory tensor transport; empty if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
        return f"{boot_id}:{os.stat('/dev/shm').st_dev}"
    except OSError:
        return ""


class VllmServicer(SharedRpcs, vllm_grpc.VllmEngineServicer):  # type: ignore[misc]
    """vLLM-only RPCs; the rest come from SharedRpcs or answer UNIMPLEMENTED."""

    _pb = vllm_pb2
    dialect = DIALECT
    version = VLLM_VERSION
    kv_role = ""

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        await self._engine.generate(
            context,
            DIALECT,
            request.request_id,
            input_ids_of(request),
            sampling_of(request),
            self._engine.rank_of(request),
        )

    async def Abort(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        self._engine.active.abort(request.request_ids)
        return vllm_pb2.AbortResponse()

    async def GetModelInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        fields = self._engine.model_info_fields()
        return vllm_pb2.GetModelInfoResponse(
            max_req_input_len=fields["max_context_length"], **fields
        )

    async def GetServerInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        config = self._engine.config
        return vllm_pb2.GetServerInfoResponse(
            kv_connector="",
            kv_role=self.kv_role,
            kv_engine_id="",
            data_parallel_size=config.dp_ranks,
            multimodal_encoder_dtype=MODEL_DTYPE.removeprefix("torch."),
            max_num_seqs=self._engine.max_running,
            shm_namespace_id=shm_namespace_id(),
            kv_cache_dtype=KV_CACHE_DTYPE,
            block_size=config.block_size,
            model_dtype=MODEL_DTYPE,
            mm_device_do_normalize=False,
            mm_item_limits="",
            engine_reasoning_parser="",
            constrained_decoding_start=CONSTRAINED_DECODING_START,
        )
