"""Helpers for the prefix cache and KV event tests: one Generate call per runtime, and a
KV event subscription read with bounded waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from tests.sim.conftest import SimProcess

RUNTIMES = ("sglang", "vllm")
WAIT_S = 30.0  # a safety net for every bounded wait: only a hang reaches it


def prompt(length: int, start: int = 100) -> list[int]:
    """``length`` distinct token ids from ``start`` on."""
    return list(range(start, start + length))


@dataclass(frozen=True)
class Answer:
    """What one Generate call answered, as far as the cache tests care."""

    messages: list[Any]
    first_at: float  # seconds from the call to its first message

    @property
    def cached(self) -> list[int]:
        """``cached_tokens`` of every message, chunks then the complete."""
        return [
            m.chunk.cached_tokens
            if m.WhichOneof("response") == "chunk"
            else m.complete.cached_tokens
            for m in self.messages
        ]

    @property
    def complete(self) -> Any:
        return self.messages[-1].complete


class Engine:
    """One runtime's Generate/FlushCache/SubscribeKvEvents on an open channel."""

    def __init__(self, runtime: str, channel: grpc.aio.Channel) -> None:
        self.runtime = runtime
        self.stub: Any = (
            sgl_grpc.SglangSchedulerStub(channel)
            if runtime == "sglang"
            else vllm_grpc.VllmEngineStub(channel)
        )

    def request(
        self,
        input_ids: Sequence[int],
        *,
        rank: int | None = None,
        lora: str = "",
        tokens: int = 2,
        stream: bool = True,
        request_id: str = "r",
    ) -> Any:
        if self.runtime == "sglang":
            request = sgl_pb2.GenerateRequest(
                request_id=request_id,
                tokenized=sgl_pb2.TokenizedInput(input_ids=input_ids),
                sampling_params=sgl_pb2.SamplingParams(max_new_tokens=tokens),
                stream=stream,
                lora_id=lora,
            )
        else:
            assert not lora, "vLLM requests carry no LoRA"
            request = vllm_pb2.GenerateRequest(
                request_id=request_id,
                tokenized=vllm_pb2.TokenizedInput(input_ids=input_ids),
                sampling_params=vllm_pb2.SamplingParams(max_tokens=tokens),
                stream=stream,
            )
        if rank is not None:
            request.data_parallel_rank = rank
        return request

    async def generate(
        self, input_ids: Sequence[int], *, metadata: Sequence[tuple[str, str]] = (), **kwargs: Any
    ) -> Answer:
        started = time.monotonic()
        call = self.stub.Generate(
            self.request(input_ids, **kwargs), metadata=tuple(metadata), timeout=WAIT_S
        )
        messages: list[Any] = []
        first_at = 0.0
        async for message in call:
            if not messages:
                first_at = time.monotonic() - started
            messages.append(message)
        return Answer(messages, first_at)

    async def flush(self) -> Any:
        return await self.stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=WAIT_S)

    async def loads(self) -> list[int]:
        """Running requests per DP rank (GetLoads)."""
        request = (
            sgl_pb2.GetLoadsRequest() if self.runtime == "sglang" else vllm_pb2.GetLoadsRequest()
        )
        answer = await self.stub.GetLoads(request, timeout=WAIT_S)
        return [load.num_running_reqs for load in answer.loads]

    @asynccontextmanager
    async def subscribe(
        self, start: int = 0, *, early_records: bool = False
    ) -> AsyncIterator[Feed]:
        call = self.stub.SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(
                start_sequence_number=start, load_records_before_first_batch=early_records
            )
        )
        feed = Feed(call)
        try:
            yield feed
        finally:
            feed.close()


class Feed:
    """A KV event subscription read in the background, so a test waits on it bounded."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for batch in self.call:
                self._queue.put_nowait(batch)
        except grpc.aio.AioRpcError as error:
            self._queue.put_nowait(error)
        self._queue.put_nowait(None)

    async def next(self, within: float = WAIT_S, *, heartbeats: bool = False) -> Any:
        """The next batch (skipping load-only ones unless ``heartbeats``); fails the test
        if none comes within ``within`` seconds or the stream ends."""
        deadline = time.monotonic() + within
        while True:
            item = await asyncio.wait_for(self._queue.get(), max(0.0, deadline - time.monotonic()))
            assert item is not None, "the subscription ended"
            assert not isinstance(item, grpc.aio.AioRpcError), f"the subscription failed: {item}"
            if heartbeats or not item.load.load_only:
                return item

    async def take(self, count: int, **kwargs: Any) -> list[Any]:
        return [await self.next(**kwargs) for _ in range(count)]

    async def error(self, within: float = WAIT_S) -> grpc.aio.AioRpcError:
        """How the subscription ended (skipping any batches before)."""
        deadline = time.monotonic() + within
        while True:
            item = await asyncio.wait_for(self._queue.get(), max(0.0, deadline - time.monotonic()))
            if isinstance(item, grpc.aio.AioRpcError):
                return item
            assert item is not None, "the subscription ended OK"

    def pending(self) -> list[Any]:
        """Batches already received and not yet taken."""
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()


@asynccontextmanager
async def engine(sim: SimProcess, runtime: str = "sglang") -> AsyncIterator[Engine]:
    async with grpc.aio.insecure_channel(sim.address) as channel:
        yield Engine(runtime, channel)


def stored_of(batch: Any) -> list[Any]:
    return [e.stored for e in batch.events if e.WhichOneof("data") == "stored"]


def removed_of(batch: Any) -> list[int]:
    return [
        h for e in batch.events if e.WhichOneof("data") == "removed" for h in e.removed.block_hashes
    ]


def kinds(batch: Any) -> list[str]:
    return [str(e.WhichOneof("data")) for e in batch.events]


def hashes(stored: Any) -> list[int]:
    return [block.block_hash for block in stored.blocks]
