"""RPCs whose messages have the same field names in the SGLang and vLLM protos.

Both servicers inherit these, pointing ``_pb`` at their own generated module, so the two
engines cannot drift apart on health, embeddings, model info, loads or admin calls.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from types import ModuleType
from typing import Any, ClassVar

from grpc.aio import ServicerContext

# The generated modules import each other relatively (``from . import common_pb2``),
# so importing them from the ``smg_grpc_proto.generated`` package needs no sys.path tricks.
from smg_grpc_proto.generated import common_pb2

from gateway_sim.engine import (
    MAX_RUNNING_REQUESTS,
    SimEngine,
)

SIM_VERSION = "sim"


def tokenizer_chunks(model: str) -> list[bytes]:
    """Two fake tokenizer chunks; real workers stream a zip in several chunks."""
    return [
        f"sim-tokenizer:{model}:vocab=32000;".encode(),
        b"eos=2;merges=none;" + bytes(range(32)),
    ]


class SharedRpcs:
    """The engine-independent half of a simulated servicer."""

    _pb: ClassVar[ModuleType]

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine
        chunks = tokenizer_chunks(engine.config.model)
        digest = hashlib.sha256(b"".join(chunks)).hexdigest()
        self._tokenizer = [
            common_pb2.GetTokenizerChunk(data=data, sha256=digest if last else "")
            for data, last in zip(chunks, (False, True), strict=True)
        ]

    async def HealthCheck(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        healthy = self._engine.healthy
        return self._pb.HealthCheckResponse(
            healthy=healthy, message="ok" if healthy else "not serving"
        )

    async def Embed(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        input_ids = request.tokenized.input_ids
        embedding = await self._engine.embed(context, request.request_id, input_ids)
        return self._pb.EmbedResponse(
            embedding=embedding, prompt_tokens=len(input_ids), embedding_dim=len(embedding)
        )

    async def GetModelInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return self._pb.GetModelInfoResponse(**self._engine.model_info_fields())

    async def GetLoads(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return self._loads(request)

    def _loads(self, request: Any) -> Any:
        """Per-rank loads: each request runs on the rank it asked for, else rank 0.

        ``token_usage`` is the larger of the rank's prefix cache occupancy and the
        running requests over MAX_RUNNING_REQUESTS (the KV their output holds), raised to
        ``--load-token-usage``."""
        dp_ranks = self._engine.config.dp_ranks
        if request.HasField("dp_rank"):
            ranks: range | list[int] = [request.dp_rank] if 0 <= request.dp_rank < dp_ranks else []
        else:
            ranks = range(dp_ranks)
        loads = []
        for rank in ranks:
            running = self._engine.running_on(rank)
            usage = max(
                self._engine.token_usage(running),
                self._engine.kv.caches[rank].usage,
                self._engine.config.load_token_usage,
            )
            loads.append(
                self._pb.SchedulerLoad(
                    dp_rank=rank,
                    num_running_reqs=running,
                    num_waiting_reqs=self._engine.config.load_waiting if rank == 0 else 0,
                    num_total_reqs=running,
                    num_used_tokens=self._engine.active.generated(rank),
                    max_running_requests=MAX_RUNNING_REQUESTS,
                    max_total_num_tokens=self._engine.kv_tokens,
                    token_usage=usage,
                    utilization=usage,
                )
            )
        return self._pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=SIM_VERSION,
            dp_rank_count=dp_ranks,
            loads=loads,
        )

    async def FlushCache(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        self._engine.kv.flush()
        return common_pb2.FlushCacheResponse(
            success=True, message=f"cache flushed on {self._engine.name}"
        )

    async def SubscribeKvEvents(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        await self._engine.kv.serve(request, context)

    async def StartProfile(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return common_pb2.ProfileResponse(success=True, message="profiling started")

    async def StopProfile(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return common_pb2.ProfileResponse(success=True, message="profiling stopped")

    async def GetTokenizer(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        for chunk in self._tokenizer:
            await context.write(chunk)
