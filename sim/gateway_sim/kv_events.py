"""``SubscribeKvEvents`` of the simulated engines: the prefix caches' changes as
``KvEventBatch`` streams, per DP rank, as the proto describes them.

Each rank numbers its own batches (1, 2, ...) and keeps the last ``--kv-history`` of them.
A subscription starts

- from ``start_sequence_number`` N > 0: every kept batch after N, rank by rank, then live;
  DATA_LOSS when a rank has dropped batches after N from its history;
- from 0: a snapshot per rank (``KvSnapshotChunk`` batches: chunk 0 begins with a
  ``cleared`` event, then ``stored`` events for every live block, parents first), numbered
  consecutively up to the rank's current sequence so live batches follow with no gap.
  A rank that has published nothing yet takes the numbers from its sequence, so its next
  live batch still continues after the snapshot.

Every batch carries the rank's ``EngineLoad`` as it is when the batch is sent. A rank that
has sent nothing on a stream for ``--kv-heartbeat-ms`` gets a ``load_only`` batch with no
events repeating its last sequence number (numbered 0 before its first batch, and only to
a subscriber that asked for ``load_records_before_first_batch``).

Every live batch goes to every subscription through a bounded queue; a subscriber that
falls ``--kv-queue`` batches behind is dropped with RESOURCE_EXHAUSTED, so a stalled
reader never makes the simulator buffer without bound.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import common_pb2

from gateway_sim.config import SimConfig
from gateway_sim.prefix_cache import Block, PrefixCache

TIER = common_pb2.KV_CACHE_TIER_DEVICE
MEDIUM = "GPU"
LOCALITY = common_pb2.KV_CACHE_LOCALITY_LOCAL
# Blocks per snapshot chunk (more when a rank has fewer sequence numbers than chunks).
SNAPSHOT_CHUNK_BLOCKS = 512
# A heartbeat may fire this early: the event loop's timers are not exact.
_HEARTBEAT_SLACK_S = 0.002

LoadOf = Callable[[int], Any]  # rank -> a fresh common_pb2.EngineLoad


class DataLoss(Exception):
    """The cursor is older than a rank's history reaches back."""


def stored_event(blocks: Sequence[Block], block_size: int, event_id: int = 0) -> Any:
    """One ``stored`` event for a run of blocks, each the parent of the next."""
    first = blocks[0]
    stored = common_pb2.KvBlocksStored(
        blocks=[
            common_pb2.KvBlock(
                block_hash=block.block_hash, token_ids=block.tokens, block_size=block_size
            )
            for block in blocks
        ],
        tier=TIER,
        medium=MEDIUM,
        locality=LOCALITY,
    )
    if first.parent is not None:
        stored.parent_block_hash = first.parent.block_hash
    if first.namespace:
        stored.lora_name = first.namespace
    return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)


def removed_event(hashes: Sequence[int], event_id: int = 0) -> Any:
    removed = common_pb2.KvBlocksRemoved(
        block_hashes=hashes, tier=TIER, medium=MEDIUM, locality=LOCALITY
    )
    return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)


def cleared_event(event_id: int = 0) -> Any:
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class Batch:
    """A batch as kept in history; the load record is added per stream when sent.

    A published batch keeps what changed (the blocks themselves, which never change)
    and makes its event protos only when a subscriber first needs them: with nobody
    subscribed, a request that stores blocks costs no proto work at all.
    """

    __slots__ = ("_changes", "_events", "sequence", "snapshot", "timestamp")

    def __init__(
        self,
        sequence: int,
        timestamp: float,
        events: list[Any] | None = None,
        snapshot: Any = None,
        changes: Callable[[], list[Any]] | None = None,
    ) -> None:
        self.sequence = sequence
        self.timestamp = timestamp
        self.snapshot = snapshot  # common_pb2.KvSnapshotChunk
        self._events = events
        self._changes = changes

    @property
    def events(self) -> list[Any]:
        if self._events is None:
            self._events = self._changes() if self._changes is not None else []
            self._changes = None
        return self._events


class Subscription:
    """One open SubscribeKvEvents call's queue of live batches."""

    def __init__(self, size: int) -> None:
        self.size = size
        # None: the subscriber fell too far behind and is dropped.
        self.queue: asyncio.Queue[tuple[int, Batch] | None] = asyncio.Queue(size)
        self.overflowed = False

    def offer(self, rank: int, batch: Batch) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait((rank, batch))
        except asyncio.QueueFull:
            # Let go of everything queued at once; the stream ends when it next looks.
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)


class RankLog:
    """One rank's sequence, bounded history and fan-out; the cache's listener."""

    def __init__(
        self,
        rank: int,
        history: int,
        block_size: int,
        subscriptions: set[Subscription],
        drop_rate: float = 0.0,
    ) -> None:
        self.rank = rank
        self._drop_rate = drop_rate
        self._rng = random.Random()
        self.sequence = 0
        self.dropped_through = 0  # highest sequence no longer in history
        self._history: deque[Batch] = deque(maxlen=history)
        self._block_size = block_size
        self._event_ids = 0
        self._subscriptions = subscriptions

    def _event_id(self) -> int:
        self._event_ids += 1
        return self._event_ids

    def changed(self, removed: Sequence[int], stored: Sequence[Block]) -> None:
        removed_id = self._event_id() if removed else 0
        stored_id = self._event_id() if stored else 0
        size = self._block_size

        def events() -> list[Any]:
            made = []
            if removed:  # room is made before the new blocks go in
                made.append(removed_event(removed, removed_id))
            if stored:
                made.append(stored_event(stored, size, stored_id))
            return made

        self._publish(Batch(0, 0.0, changes=events))

    def cleared(self) -> None:
        self._publish(Batch(0, 0.0, [cleared_event(self._event_id())]))

    def _publish(self, batch: Batch) -> None:
        self.sequence += 1
        batch.sequence = self.sequence
        batch.timestamp = time.time()
        history = self._history
        if len(history) == history.maxlen:
            self.dropped_through = history[0].sequence
        history.append(batch)
        if self._drop_rate and self._rng.random() < self._drop_rate:
            return  # lost on the way (kept in history: a resume from the cursor gets it)
        for subscription in self._subscriptions:
            subscription.offer(self.rank, batch)

    def since(self, cursor: int) -> list[Batch]:
        """Kept batches after ``cursor``; DataLoss if some were dropped."""
        if cursor < self.dropped_through:
            raise DataLoss(
                f"start_sequence_number {cursor} is older than DP rank {self.rank}'s "
                f"history: batches {cursor + 1}..{self.dropped_through} were dropped "
                f"(it keeps {self._history.maxlen}, the oldest kept is "
                f"{self.dropped_through + 1}); subscribe from 0 for a snapshot"
            )
        return [batch for batch in self._history if batch.sequence > cursor]

    def snapshot(self, cache: PrefixCache) -> list[Batch]:
        """The cache's live blocks as snapshot chunks ending at the current sequence."""
        blocks = list(cache.blocks())
        per_chunk = SNAPSHOT_CHUNK_BLOCKS
        count = max(1, -(-len(blocks) // per_chunk))
        if self.sequence == 0:
            self.sequence = count  # allocate: the next live batch follows the snapshot
        elif count > self.sequence:  # fewer numbers than chunks: make the chunks bigger
            per_chunk = -(-len(blocks) // self.sequence)
            count = -(-len(blocks) // per_chunk)
        now = time.time()
        first = self.sequence - count + 1
        batches = []
        for index in range(count):
            part = blocks[index * per_chunk : (index + 1) * per_chunk]
            events = [cleared_event()] if index == 0 else []
            run: list[Block] = []
            for block in part:
                if run and block.parent is not run[-1]:
                    events.append(stored_event(run, cache.block_size))
                    run = []
                run.append(block)
            if run:
                events.append(stored_event(run, cache.block_size))
            chunk = common_pb2.KvSnapshotChunk(
                index=index, count=count, blocks=len(blocks), unknown_before=0
            )
            batches.append(Batch(first + index, now, events, chunk))
        return batches


class KvEvents:
    """The engine's prefix caches (one per DP rank) and their event logs."""

    def __init__(self, config: SimConfig, load_of: LoadOf) -> None:
        self.enabled = config.kv_events
        self.config = config
        self.load_of = load_of
        self._subscriptions: set[Subscription] = set()
        seed = os.urandom(16)  # per process: subscribers cannot recompute our hashes
        self.logs = [
            RankLog(
                rank,
                config.kv_history,
                config.block_size,
                self._subscriptions,
                config.kv_drop_rate,
            )
            for rank in range(config.dp_ranks)
        ]
        self.caches = [
            PrefixCache(config.block_size, config.kv_blocks, seed, log if self.enabled else None)
            for log in self.logs
        ]

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    def flush(self) -> None:
        """FlushCache: every rank's cache cleared, a ``cleared`` batch on each."""
        for cache in self.caches:
            cache.flush()

    def _initial(self, start: int) -> list[tuple[int, Batch]]:
        """What a new subscription gets before live batches (no await: see ``serve``)."""
        if start == 0:
            return [
                (log.rank, batch)
                for log, cache in zip(self.logs, self.caches, strict=True)
                for batch in log.snapshot(cache)
            ]
        replays = [(log.rank, log.since(start)) for log in self.logs]  # DataLoss first
        return [(rank, batch) for rank, batches in replays for batch in batches]

    async def serve(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        """One SubscribeKvEvents call, until the client goes away or falls behind."""
        if not self.enabled:
            await _abort(context, grpc.StatusCode.UNIMPLEMENTED, "KV events are disabled")
        subscription = Subscription(self.config.kv_queue)
        try:
            initial = self._initial(request.start_sequence_number)
        except DataLoss as exc:
            await _abort(context, grpc.StatusCode.DATA_LOSS, str(exc))
        # Registered in the same step as the snapshot/replay was taken: no batch is
        # missed or sent twice between the two.
        self._subscriptions.add(subscription)
        try:
            await _Stream(self, request, context, subscription).run(initial)
        finally:
            self._subscriptions.discard(subscription)


class _Stream:
    """Writes one subscription's batches, with its load records and heartbeats."""

    def __init__(
        self,
        events: KvEvents,
        request: Any,
        context: ServicerContext[Any, Any],
        subscription: Subscription,
    ) -> None:
        self._events = events
        self._context = context
        self._subscription = subscription
        self._early_records = request.load_records_before_first_batch
        self._sample = 0
        heartbeat_s = events.config.kv_heartbeat_s
        self._heartbeat_s = heartbeat_s if heartbeat_s > 0 else None
        now = time.monotonic()
        self._last_sent = {log.rank: now for log in events.logs}

    async def run(self, initial: list[tuple[int, Batch]]) -> None:
        for rank, batch in initial:
            await self._send(rank, batch)
        queue = self._subscription.queue
        while True:
            try:
                async with asyncio.timeout(self._until_heartbeat()):
                    item = await queue.get()
            except TimeoutError:
                await self._heartbeats()
                continue
            if item is None:
                await _abort(
                    self._context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"KV event subscriber too slow: more than {self._subscription.size} "
                    "batches waiting; subscribe again from the last sequence received",
                )
            await self._send(*item)

    def _until_heartbeat(self) -> float | None:
        if self._heartbeat_s is None:
            return None
        due = min(self._last_sent.values()) + self._heartbeat_s
        return max(0.0, due - time.monotonic())

    async def _heartbeats(self) -> None:
        """A load-only batch for each rank that has been quiet for the heartbeat period."""
        assert self._heartbeat_s is not None
        now = time.monotonic()
        for log in self._events.logs:
            if now + _HEARTBEAT_SLACK_S < self._last_sent[log.rank] + self._heartbeat_s:
                continue
            self._last_sent[log.rank] = now
            if log.sequence == 0 and not self._early_records:
                continue  # a subscriber that cannot take a batch numbered 0
            await self._send(log.rank, Batch(log.sequence, time.time(), []), load_only=True)

    async def _send(self, rank: int, batch: Batch, load_only: bool = False) -> None:
        self._sample += 1
        load = self._events.load_of(rank)
        load.sample = self._sample
        load.load_only = load_only
        message = common_pb2.KvEventBatch(
            sequence_number=batch.sequence,
            timestamp=batch.timestamp,
            events=batch.events,
            dp_rank=rank,
            load=load,
        )
        if batch.snapshot is not None:
            message.snapshot.CopyFrom(batch.snapshot)
        await self._context.write(message)
        self._last_sent[rank] = time.monotonic()


async def _abort(
    context: ServicerContext[Any, Any], code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable")
