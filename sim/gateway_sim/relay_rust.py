"""``--kv-relay rust``: SubscribeKvEvents as the Rust relay of smg-grpc-servicer's
engine_servicer serves it, which keeps every rank's history and serves snapshots.

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

A subscriber that falls ``--kv-queue`` batches behind is dropped with RESOURCE_EXHAUSTED,
so a stalled reader never makes the simulator buffer without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import common_pb2

from gateway_sim.kv_log import Batch, KvSource, RankLog, Subscription, cleared_event, stored_event
from gateway_sim.prefix_cache import Block, PrefixCache

# Blocks per snapshot chunk (more when a rank has fewer sequence numbers than chunks).
SNAPSHOT_CHUNK_BLOCKS = 512
# A heartbeat may fire this early: the event loop's timers are not exact.
_HEARTBEAT_SLACK_S = 0.002


class DataLoss(Exception):
    """The cursor is older than a rank's history reaches back."""


def since(log: RankLog, cursor: int) -> list[Batch]:
    """A rank's kept batches after ``cursor``; DataLoss if some were dropped."""
    if cursor < log.dropped_through:
        raise DataLoss(
            f"start_sequence_number {cursor} is older than DP rank {log.rank}'s "
            f"history: batches {cursor + 1}..{log.dropped_through} were dropped "
            f"(it keeps {log.history.maxlen}, the oldest kept is "
            f"{log.dropped_through + 1}); subscribe from 0 for a snapshot"
        )
    return [batch for batch in log.history if batch.sequence > cursor]


def snapshot(log: RankLog, cache: PrefixCache) -> list[Batch]:
    """A rank's live blocks as snapshot chunks ending at its current sequence."""
    blocks = list(cache.blocks())
    per_chunk = SNAPSHOT_CHUNK_BLOCKS
    count = max(1, -(-len(blocks) // per_chunk))
    if not log.published:
        log.sequence = count  # allocate: the next live batch follows the snapshot
    elif count > log.sequence:  # fewer numbers than chunks: make the chunks bigger
        per_chunk = -(-len(blocks) // log.sequence)
        count = -(-len(blocks) // per_chunk)
    now = time.time()
    first = log.sequence - count + 1
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
        batches.append(Batch(first + index, now, events=events, snapshot=chunk))
    return batches


def _initial(events: KvSource, start: int) -> list[tuple[int, Batch]]:
    """What a new subscription gets before live batches (no await: see ``serve``)."""
    if start == 0:
        return [
            (log.rank, batch)
            for log, cache in zip(events.logs, events.caches, strict=True)
            for batch in snapshot(log, cache)
        ]
    replays = [(log.rank, since(log, start)) for log in events.logs]  # DataLoss first
    return [(rank, batch) for rank, batches in replays for batch in batches]


async def serve(events: KvSource, request: Any, context: ServicerContext[Any, Any]) -> None:
    """One SubscribeKvEvents call, until the client goes away or falls behind."""
    subscription = Subscription(events.config.kv_queue)
    try:
        initial = _initial(events, request.start_sequence_number)
    except DataLoss as exc:
        await _abort(context, grpc.StatusCode.DATA_LOSS, str(exc))
    # Registered in the same step as the snapshot/replay was taken: no batch is
    # missed or sent twice between the two.
    events.subscribe(subscription)
    try:
        await _Stream(events, request, context, subscription).run(initial)
    finally:
        events.unsubscribe(subscription)


class _Stream:
    """Writes one subscription's batches, with its load records and heartbeats."""

    def __init__(
        self,
        events: KvSource,
        request: Any,
        context: ServicerContext[Any, Any],
        subscription: Subscription,
    ) -> None:
        self._events = events
        self._load_of: Callable[[int], Any] = events.load_of
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
            sequence = log.sequence if log.published else 0
            if sequence == 0 and not self._early_records:
                continue  # a subscriber that cannot take a batch numbered 0
            await self._send(log.rank, Batch(sequence, time.time(), events=[]), load_only=True)

    async def _send(self, rank: int, batch: Batch, load_only: bool = False) -> None:
        self._sample += 1
        load = self._load_of(rank)
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
