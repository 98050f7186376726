"""RPCs whose messages have the same field names in the SGLang and vLLM protos.

Both servicers inherit these, pointing ``_pb`` at their own generated module and
``dialect`` at their engine's, so the two engines cannot drift apart on health,
embeddings, loads or admin calls.
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

from gateway_sim.dialect import Dialect
from gateway_sim.engine import SimEngine

SIM_VERSION = "sim"


# The load record's sections a SchedulerLoad may carry, copied when present.
_SECTIONS = ("memory", "queues", "speculative", "lora", "disaggregation")


def tokenizer_chunks(model: str, vocab_size: int) -> list[bytes]:
    """Two fake tokenizer chunks; real workers stream a zip in several chunks."""
    return [
        f"sim-tokenizer:{model}:vocab={vocab_size};".encode(),
        b"eos=2;merges=none;" + bytes(range(32)),
    ]


def engine_load_of(load: Any) -> Any:
    """The KV event stream's load record made from one rank's GetLoads entry, field for
    field, as the servicers make theirs (the queued token-work included)."""
    record = common_pb2.EngineLoad(
        running_requests=max(0, load.num_running_reqs),
        waiting_requests=max(0, load.num_waiting_reqs),
        waiting_uncached_tokens=max(0, load.num_waiting_uncached_tokens),
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        max_running_requests=max(0, load.max_running_requests),
        cache_hit_rate=load.cache_hit_rate,
        num_used_tokens=load.num_used_tokens,
        max_total_num_tokens=load.max_total_num_tokens,
    )
    present = {field.name for field, _ in load.ListFields()}
    for name in _SECTIONS:
        if name not in present:
            continue
        target = getattr(record, name)  # the same fields, under the common proto's type
        for field, value in getattr(load, name).ListFields():
            if field.name in target.DESCRIPTOR.fields_by_name:
                setattr(target, field.name, value)
    return record


class SharedRpcs:
    """The engine-independent half of a simulated servicer."""

    _pb: ClassVar[ModuleType]
    dialect: ClassVar[Dialect]
    version: ClassVar[str] = SIM_VERSION  # GetLoads' engine version

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine
        engine.max_running = engine.config.max_running or self.dialect.max_running_requests
        engine.kv.load_source = self.load_record
        engine.kv.disabled_message = self.dialect.kv_events_disabled
        chunks = tokenizer_chunks(engine.config.model, engine.config.vocab_size)
        digest = hashlib.sha256(b"".join(chunks)).hexdigest()
        self._tokenizer = [
            common_pb2.GetTokenizerChunk(data=data, sha256=digest if last else "")
            for data, last in zip(chunks, (False, True), strict=True)
        ]

    async def HealthCheck(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        healthy = self._engine.healthy
        return self._pb.HealthCheckResponse(
            healthy=healthy, message=self.dialect.health_message if healthy else "not serving"
        )

    async def Embed(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        input_ids = request.tokenized.input_ids
        embedding = await self._engine.embed(context, request.request_id, input_ids)
        return self._pb.EmbedResponse(
            embedding=embedding, prompt_tokens=len(input_ids), embedding_dim=len(embedding)
        )

    async def GetLoads(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return self._loads(request)

    def _loads(self, request: Any) -> Any:
        """Per-rank loads: each request runs on the rank it asked for, else rank 0."""
        dp_ranks = self._engine.config.dp_ranks
        if request.HasField("dp_rank"):
            ranks: range | list[int] = [request.dp_rank] if 0 <= request.dp_rank < dp_ranks else []
        else:
            ranks = range(dp_ranks)
        return self._pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=self.version,
            dp_rank_count=dp_ranks,
            loads=[self._scheduler_load(rank) for rank in ranks],
        )

    def _scheduler_load(self, rank: int) -> Any:
        """One rank's GetLoads entry. ``token_usage`` is the larger of the rank's prefix
        cache occupancy and the running requests over the running window (the KV their
        output holds), raised to ``--load-token-usage``."""
        running = self._engine.running_on(rank)
        waiting = self._engine.waiting_on(rank)
        usage = max(
            self._engine.token_usage(running),
            self._engine.kv.caches[rank].usage,
            self._engine.config.load_token_usage,
        )
        return self._pb.SchedulerLoad(
            dp_rank=rank,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            num_used_tokens=self._engine.active.generated(rank),
            max_running_requests=self._engine.max_running,
            max_total_num_tokens=self._engine.kv_tokens,
            token_usage=usage,
            utilization=usage,
        )

    def load_record(self, rank: int) -> Any:
        """The load record the (python relay's) KV event batches of ``rank`` carry: its
        GetLoads figures, so the two always agree."""
        return engine_load_of(self._scheduler_load(rank))

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
