"""The simulated SGLang scheduler: ``sglang.grpc.scheduler.SglangScheduler``, answering
as smg-grpc-servicer 0.14.1's SGLang servicer does.

- Generate's chunks carry their own tokens and count the choice's total so far (the
  scheduler's ``meta_info``); a streamed Complete repeats the last chunk's tokens with
  the totals, an unstreamed one holds them all. An unstreamed n>1 request's Completes
  all say index 0 (the servicer sets none), and its choices find the prompt cached (the
  scheduler prefills it once first).
- The scheduler's checks: a prompt of ``max_req_input_len`` tokens or more is refused
  (INVALID_ARGUMENT, its words); ``max_new_tokens`` is clamped to what the context
  leaves; a stop on EOS names the token.
- Abort stops the request (GetLoads no longer counts it) and says so, but its stream
  gets nothing more, no Complete and no status, until the call's deadline or a cancel
  (``--abort-completes`` / ``x-sim-abort-completes``: a Complete ``abort``, as vLLM's).
- ``return_logprob``: ``top_logprobs_num`` top logprobs per output token, the prompt's
  too unless ``logprob_start_len`` is -1 (from its first token whatever the start).
- GetModelInfo says what the servicer says of any model SGLang 0.5.23 serves: its own
  defaults for what the scheduler never tells it (vocabulary 128,256, no EOS or PAD
  ids) and the KV pool's size as the context length. ``--vocab-size`` still bounds the
  ids it accepts.
- LoRA adapters, with ``--max-loras N``: at most N loaded (a load past it fails, as
  SGLang's ``max_loaded_loras``), each load taking ``--lora-load-ms``; a Generate naming
  an adapter not loaded is refused (INVALID_ARGUMENT). Without it, any ``lora_id`` is
  taken as if loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import struct_pb2, timestamp_pb2
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway_sim.config import SimConfig
from gateway_sim.dialect import Dialect, Refused
from gateway_sim.engine import SimEngine
from gateway_sim.model import ARCHITECTURES, BOS_TOKEN_ID, MODEL_TYPE
from gateway_sim.plan import Sampling
from gateway_sim.shared import SIM_VERSION, SharedRpcs

SERVICE_NAME: str = sgl_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
# How many ids a refusal lists before it elides the rest (trailers have a size limit).
_LISTED_IDS = 64
# GetModelInfo's figures smg-grpc-servicer 0.14.1 falls back to, SGLang 0.5.23's
# scheduler sending it none (`scheduler_info.get("vocab_size", 128256)`, ...).
SERVICER_VOCAB_SIZE = 128_256
SERVICER_LABELS = '{"0": "LABEL_0", "1": "LABEL_1"}'
WEIGHT_VERSION = "default"
# The tiny Llama's memory (float32): its weights, and K and V of 2 layers x 2 KV heads x
# 32 dimensions a token.
WEIGHT_GB = 0.002
KV_BYTES_PER_TOKEN = 1024


def max_req_len(config: SimConfig) -> int:
    """The scheduler's bound on prompt plus output: one short of the context and of
    the KV pool."""
    return min(config.max_model_len - 1, config.kv_blocks * config.block_size - 1)


def max_req_input_len(config: SimConfig) -> int:
    """The longest prompt the scheduler takes is one short of this."""
    return max_req_len(config) - 5


class SglangDialect(Dialect):
    """SGLang's Generate answers and checks (the scheduler's, and the tokenizer
    manager's vocabulary check, which the gRPC path would otherwise skip)."""

    chunk_counts_total = True
    complete_counts_total = True
    names_eos = True
    indexes_unstreamed = False
    prefix_pass = True
    max_running_requests = 4096  # what SGLang 0.5.23 reports here (its default window)
    abort_ends_stream = False
    health_message = "Health check passed"
    kv_events_disabled = (
        'KV cache events not enabled. Start SGLang with --kv-events-config \'{"publisher": "zmq"}\''
    )

    def check(self, config: SimConfig, input_ids: Sequence[int] | None, sampling: Sampling) -> None:
        if input_ids is None:
            raise Refused("Tokenized input must be provided")
        length = len(input_ids)
        limit = max_req_input_len(config)
        if length >= limit:
            raise Refused(
                f"Input length ({length} tokens) exceeds the maximum allowed length "
                f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        vocab = config.vocab_size
        if any(token >= vocab for token in input_ids):
            listed = list(input_ids[:_LISTED_IDS])
            shown = str(listed) if length <= _LISTED_IDS else f"{str(listed)[:-1]}, ...]"
            raise Refused(
                f"The input_ids {shown} contains values greater than the vocab size ({vocab})."
            )

    def room(self, config: SimConfig, kv_tokens: int, prompt_tokens: int) -> int:
        return max_req_len(config) - prompt_tokens - 1


DIALECT = SglangDialect(sgl_pb2, with_request_id=True)


def tokenized_ids(request: Any) -> Sequence[int] | None:
    """The request's prompt; None when it carries no tokenized input (refused)."""
    return request.tokenized.input_ids if request.HasField("tokenized") else None


DEFAULT_BOOTSTRAP_PORT = 8998  # what every SGLang worker reports but a prefill given one


def sampling_of(request: Any) -> Sampling:
    params = request.sampling_params
    logprobs = request.top_logprobs_num if request.return_logprob else None
    return Sampling(
        n=params.n,
        max_tokens=params.max_new_tokens if params.HasField("max_new_tokens") else None,
        stream=request.stream,
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=logprobs if request.logprob_start_len != -1 else None,
    )


class SglangServicer(SharedRpcs, sgl_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """SGLang-only RPCs; the rest come from SharedRpcs or answer UNIMPLEMENTED."""

    _pb = sgl_pb2
    dialect = DIALECT

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        self._loras: dict[str, Any] = {}

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        lora_id = request.lora_id
        if lora_id and self._engine.config.max_loras is not None and lora_id not in self._loras:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"The following requested LoRA adapters are not loaded: {{'{lora_id}'}}\n"
                f"Loaded adapters: {set(self._lora_ids()) or '{}'}.",
            )
        await self._engine.generate(
            context,
            DIALECT,
            request.request_id,
            tokenized_ids(request),
            sampling_of(request),
            self._engine.rank_of(request),
            request.lora_id,
        )

    async def Abort(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        # The servicer hands the abort to the scheduler and says so, found or not.
        self._engine.active.abort((request.request_id,))
        return sgl_pb2.AbortResponse(success=True, message=f"Request {request.request_id} aborted")

    async def GetModelInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        config = self._engine.config
        return sgl_pb2.GetModelInfoResponse(
            model_path=config.model_path,
            tokenizer_path=config.model_path,
            is_generation=True,
            weight_version=WEIGHT_VERSION,
            served_model_name=config.model,
            max_context_length=self._engine.kv_tokens,
            vocab_size=SERVICER_VOCAB_SIZE,
            model_type=MODEL_TYPE,
            bos_token_id=BOS_TOKEN_ID,
            max_req_input_len=max_req_input_len(config),
            architectures=list(ARCHITECTURES),
            id2label_json=SERVICER_LABELS,
            num_labels=2,
        )

    async def GetServerInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        config = self._engine.config
        server_args = struct_pb2.Struct()
        server_args.update(
            {
                "model_path": config.model_path,
                "served_model_name": config.model,
                "tokenizer_path": config.model_path,
                "disaggregation_mode": "null",
                "disaggregation_bootstrap_port": DEFAULT_BOOTSTRAP_PORT,
                "tp_size": 1,
                "dp_size": config.dp_ranks,
                "page_size": config.block_size,
                "context_length": config.max_model_len,
                "max_running_requests": self._engine.max_running,
                "is_embedding": False,
            }
        )
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update({"max_total_num_tokens": self._engine.kv_tokens})
        start_time = timestamp_pb2.Timestamp()
        start_time.FromSeconds(int(self._engine.started_at))
        return sgl_pb2.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=len(self._engine.active),
            last_receive_timestamp=self._engine.last_received,
            uptime_seconds=self._engine.uptime(),
            sglang_version=SIM_VERSION,
            server_type="grpc",
            start_time=start_time,
            max_total_num_tokens=self._engine.kv_tokens,
        )

    def _scheduler_load(self, rank: int) -> Any:
        """The rank's load with the sections the servicer always fills: memory, the
        disaggregation mode (``null``: a regular worker) and the queues."""
        load = super()._scheduler_load(rank)
        tokens = self._engine.kv_tokens
        load.memory.CopyFrom(
            sgl_pb2.MemoryMetrics(
                weight_gb=WEIGHT_GB,
                kv_cache_gb=round(tokens * KV_BYTES_PER_TOKEN / 2**30, 3),
                token_capacity=tokens,
            )
        )
        load.disaggregation.mode = "null"
        load.queues.SetInParent()
        return load

    async def GetLoads(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        response = self._loads(request)
        dp_ranks = self._engine.config.dp_ranks
        engine = self._engine
        running = sum(engine.running_on(rank) for rank in range(dp_ranks))
        waiting = sum(engine.schedulers[rank].waiting for rank in range(dp_ranks))
        mean_usage = engine.token_usage(running) / dp_ranks
        response.aggregate.CopyFrom(
            sgl_pb2.AggregateMetrics(
                total_running_reqs=running,
                total_waiting_reqs=waiting,
                total_reqs=running + waiting,
                avg_token_usage=mean_usage,
                avg_utilization=mean_usage,
            )
        )
        return response

    # ------------------------------------------------------------ LoRA adapters

    def _lora_ids(self) -> list[str]:
        return sorted(self._loras)

    async def LoadLoRAAdapter(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        if not request.lora_id or not request.lora_name:
            return sgl_pb2.LoadLoRAAdapterResponse(
                success=False,
                message="lora_name and lora_id are required",
                loaded_lora_ids=self._lora_ids(),
            )
        config = self._engine.config
        if config.lora_load_s:
            await asyncio.sleep(config.lora_load_s)
        limit = config.max_loras
        if limit is not None and request.lora_id not in self._loras and len(self._loras) >= limit:
            return sgl_pb2.LoadLoRAAdapterResponse(
                success=False,
                message=f"Failed to load LoRA adapter {request.lora_name}: the maximum number "
                f"of loaded LoRA adapters ({limit}) is reached; unload one first",
                loaded_lora_ids=self._lora_ids(),
            )
        self._loras[request.lora_id] = sgl_pb2.LoadedLoRAAdapter(
            lora_id=request.lora_id,
            lora_name=request.lora_name,
            lora_path=request.lora_path,
            pinned=request.pinned,
        )
        return sgl_pb2.LoadLoRAAdapterResponse(success=True, loaded_lora_ids=self._lora_ids())

    async def UnloadLoRAAdapter(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        found = [
            lora_id
            for lora_id, adapter in self._loras.items()
            if (request.lora_id and lora_id == request.lora_id)
            or (not request.lora_id and adapter.lora_name == request.lora_name)
        ]
        for lora_id in found:
            del self._loras[lora_id]
        return sgl_pb2.UnloadLoRAAdapterResponse(
            success=bool(found),
            message="" if found else "adapter not found",
            loaded_lora_ids=self._lora_ids(),
        )

    async def ListLoadedLoRAAdapters(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return sgl_pb2.ListLoadedLoRAAdaptersResponse(
            loaded_adapters=[self._loras[lora_id] for lora_id in self._lora_ids()]
        )
