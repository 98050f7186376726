"""Following one worker's KV events (`SubscribeKvEvents`) into the prefix index.

One subscription per worker carries every DP rank's batches; each rank has its own
sequence. The follower keeps a cursor per rank: a duplicate is skipped, a gap makes it
subscribe again from its cursor, `DATA_LOSS` (the cursor is older than the worker keeps)
drops the worker's entries and starts over from a snapshot, and a broken connection
starts over from a snapshot too (the worker may have restarted, its sequences with it).
A worker that answers UNIMPLEMENTED has no KV events: the index then learns from the
gateway's own placements. Every batch's load record refreshes the worker's load.
"""

from __future__ import annotations

import asyncio
import time
from enum import StrEnum

import grpc
import structlog
from grpc import aio
from smg_grpc_proto.generated import common_pb2

from gateway.engines.base import EngineAdapter
from gateway.fleet.worker import LoadReport, Worker
from gateway.kv.index import KvIndex, StoredBlock

log = structlog.get_logger("gateway.kv")

DEVICE_TIERS = (common_pb2.KV_CACHE_TIER_UNSPECIFIED, common_pb2.KV_CACHE_TIER_DEVICE)
MAX_BACKOFF_S = 8.0


class FollowState(StrEnum):
    CONNECTING = "connecting"
    FOLLOWING = "following"
    UNSUPPORTED = "unsupported"  # no KV events: placements teach the index
    RECONNECTING = "reconnecting"


class Gap(Exception):
    """A batch's sequence skipped ahead of the cursor: some batches never arrived."""


def namespace_of(stored: common_pb2.KvBlocksStored) -> str:
    """The cache namespace, spelled as the adapters spell a request's."""
    parts = []
    if stored.HasField("lora_name") and stored.lora_name:
        parts.append(f"lora:{stored.lora_name}")
    if stored.HasField("cache_salt") and stored.cache_salt:
        parts.append(f"salt:{stored.cache_salt}")
    return "|".join(parts)


def on_device(tier: int, cache_level: int | None, locality: int) -> bool:
    """Only blocks in the worker's own device memory make a prompt cheap to prefill."""
    if locality == common_pb2.KV_CACHE_LOCALITY_REMOTE:
        return False
    return tier in DEVICE_TIERS and not cache_level


class KvFollower:
    def __init__(self, worker: Worker, adapter: EngineAdapter, index: KvIndex) -> None:
        self.worker = worker
        self.index = index
        self.state = FollowState.CONNECTING
        self.cursors: dict[int, int] = {}
        self.events: dict[str, int] = {}  # by kind: stored, removed, cleared
        self.resyncs: dict[str, int] = {}  # by reason: gap, data_loss, reconnect
        self._loads: dict[int, common_pb2.EngineLoad] = {}
        self._subscribe = worker.channel.unary_stream(
            adapter.path("SubscribeKvEvents"),
            request_serializer=common_pb2.SubscribeKvEventsRequest.SerializeToString,
            response_deserializer=common_pb2.KvEventBatch.FromString,
        )

    async def run(self) -> None:
        """Follow until cancelled (or until the worker turns out to have no KV events)."""
        backoff = 0.5
        start = 0
        while True:
            try:
                await self._follow(start)
                start = 0  # the worker ended the stream: start over from a snapshot
            except Gap:
                start = min(self.cursors.values())
                self._resync("gap")
                continue
            except aio.AioRpcError as error:
                code = error.code()
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    self.state = FollowState.UNSUPPORTED
                    self.index.drop_worker(self.worker.id)
                    log.info("kv_events_unsupported", worker=self.worker.id)
                    return
                if code is grpc.StatusCode.DATA_LOSS:
                    self.index.drop_worker(self.worker.id)
                    self.cursors.clear()
                    self._resync("data_loss")
                    start = 0
                    continue
                if self.state is FollowState.FOLLOWING:
                    self._resync("reconnect")
                    backoff = 0.5  # it worked until now: the wait starts over
                self.state = FollowState.RECONNECTING
                start = 0
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _resync(self, reason: str) -> None:
        self.resyncs[reason] = self.resyncs.get(reason, 0) + 1
        log.info("kv_resync", worker=self.worker.id, reason=reason)

    async def _follow(self, start: int) -> None:
        request = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start, load_records_before_first_batch=True
        )
        call = self._subscribe(request)
        try:
            async for batch in call:
                self.state = FollowState.FOLLOWING
                self.apply(batch)
        finally:
            call.cancel()

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        """One batch: its load record, then its events if they are the next ones."""
        rank = batch.dp_rank if batch.HasField("dp_rank") else 0
        slot = (self.worker.id, rank)
        if batch.HasField("load"):
            self._load(rank, batch.load)
            if batch.load.load_only:
                return
        sequence = batch.sequence_number
        cursor = self.cursors.get(rank)
        if batch.HasField("snapshot"):
            if batch.snapshot.index == 0:
                self.index.clear(slot)
        elif cursor is not None:
            if sequence <= cursor:
                return  # seen already (a replay overlapping what arrived)
            if sequence != cursor + 1:
                raise Gap
        self.index.follow(slot)
        for event in batch.events:
            self._event(slot, event)
        self.cursors[rank] = sequence

    def _event(self, slot: tuple[str, int], event: common_pb2.KvCacheEvent) -> None:
        kind = event.WhichOneof("data") or "unknown"
        self.events[kind] = self.events.get(kind, 0) + 1
        if kind == "stored":
            stored = event.stored
            level = stored.blocks[0].cache_level if stored.blocks else 0
            if not on_device(stored.tier, level, stored.locality):
                return
            self.index.store(
                slot,
                [StoredBlock(b.block_hash, b.token_ids) for b in stored.blocks],
                stored.parent_block_hash if stored.HasField("parent_block_hash") else None,
                namespace_of(stored),
                stored.blocks[0].block_size or None if stored.blocks else None,
            )
        elif kind == "removed":
            removed = event.removed
            if on_device(removed.tier, removed.cache_level, removed.locality):
                self.index.remove(slot, removed.block_hashes)
        elif kind == "cleared":
            self.index.clear(slot)
            self.index.follow(slot)

    def _load(self, rank: int, load: common_pb2.EngineLoad) -> None:
        """The worker's load, summed over its ranks, as fresh as its last batch."""
        self._loads[rank] = load
        loads = self._loads.values()
        self.worker.load = LoadReport(
            running=sum(x.running_requests for x in loads),
            waiting=sum(x.waiting_requests for x in loads),
            token_usage=max(x.token_usage for x in loads),
            at=time.monotonic(),
            own=self.worker.inflight,
        )
