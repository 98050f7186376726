"""``--kv-relay python`` (the default): SubscribeKvEvents as smg-grpc-servicer 0.14.1's
Python relay serves it, relaying each DP rank's publisher as it publishes.

- A subscription is live only: it sends its (empty) headers at once, then every batch
  published from then on, under the rank's own sequence, which starts at 0 with the
  process (vLLM's publisher numbering; a restarted worker starts again). No history, no
  snapshot: a non-zero ``start_sequence_number`` is refused OUT_OF_RANGE.
- A batch lost on the way (``--kv-drop-rate``, or more than ``--kv-queue`` waiting) shows
  as a gap at the rank's next batch, and the stream ends DATA_LOSS (a publisher without
  a replay endpoint cannot fill it).
- Events as the relay normalizes the engine's: event ids count per stream from 1; every
  batch names its rank; stores and removals as the engine's publisher emits them (the
  per-engine table ``PUBLISHERS``).
- Every batch carries the load record (the servicer's GetLoads figures for the rank,
  ``KvEvents.load_source``), numbered per stream; the first record and the heartbeats
  carry all of it, later event batches the routing core only. Once a batch has gone, a
  ``load_only`` batch (no events, the last batch's rank and sequence) follows when the
  record moves, checked every 0.1 s, or after ``--kv-heartbeat-ms`` of silence
  (``--kv-heartbeat-backoff-ms`` once two heartbeats in a row carried the same record).
  Nothing goes before the first batch: a heartbeat would have no sequence to repeat.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import common_pb2

from gateway_sim.kv_log import (
    Batch,
    KvSource,
    Subscription,
    cleared_event,
    removed_event,
    stored_event,
)

OUT_OF_RANGE_MESSAGE = (
    "KV event replay cursors are per subscription; resubscribe with zero and rebuild"
)
# How often an idle stream looks at the load record.
LOAD_TICK_S = 0.1
# The record's fields beyond the routing core: on the first record and heartbeats only.
TELEMETRY = (
    "cache_hit_rate",
    "num_used_tokens",
    "max_total_num_tokens",
    "memory",
    "queues",
    "speculative",
    "lora",
    "disaggregation",
)


@dataclass(frozen=True, slots=True)
class Publisher:
    """How an engine's KV event publisher shapes what the relay forwards."""

    medium: str | None  # the medium its events name (None: unnamed, the device)
    group_idx: int | None  # the KV cache group its events name
    spec_kind: str | None  # the kind of that group its stores name
    runs: bool  # one stored event per run of blocks (else one per block)
    # Its first batch begins with a `cleared`: the servicer's warm-up flushed the cache
    # at start, and the engine publishes that with its next step's events.
    cleared_at_start: bool


PUBLISHERS = {
    "vllm": Publisher(
        medium="GPU", group_idx=0, spec_kind="full_attention", runs=True, cleared_at_start=True
    ),
    "sglang": Publisher(
        medium=None, group_idx=None, spec_kind=None, runs=False, cleared_at_start=False
    ),
}


def load_changed(last: Any, current: Any) -> bool:
    """Whether the record moved enough for a ``load_only`` batch of its own: a count,
    the window, KV usage by half a percent, the rate by 5 % or 50 tokens/s."""
    if (
        last.running_requests != current.running_requests
        or last.waiting_requests != current.waiting_requests
        or last.HasField("waiting_uncached_tokens") != current.HasField("waiting_uncached_tokens")
        or last.waiting_uncached_tokens != current.waiting_uncached_tokens
        or last.max_running_requests != current.max_running_requests
        or abs(last.token_usage - current.token_usage) > 0.005
        or abs(_active(last) - _active(current)) > 0.005
    ):
        return True
    delta = float(abs(last.gen_throughput - current.gen_throughput))
    return delta > 50.0 or delta > 0.05 * max(last.gen_throughput, current.gen_throughput)


def _active(record: Any) -> float:
    return float(
        record.active_token_usage if record.HasField("active_token_usage") else record.token_usage
    )


async def serve(events: KvSource, request: Any, context: ServicerContext[Any, Any]) -> None:
    """One SubscribeKvEvents call, until the client goes away or a batch is lost."""
    if request.start_sequence_number:
        await _abort(context, grpc.StatusCode.OUT_OF_RANGE, OUT_OF_RANGE_MESSAGE)
    subscription = Subscription(events.config.kv_queue, lossy=True)
    events.subscribe(subscription)  # before the headers: they tell the client it is on
    try:
        await context.send_initial_metadata(())
        await _LiveStream(events, context, subscription).run()
    finally:
        events.unsubscribe(subscription)


class _LiveStream:
    """One subscription: its cursors per rank, event ids, load records and heartbeats."""

    def __init__(
        self, events: KvSource, context: ServicerContext[Any, Any], subscription: Subscription
    ) -> None:
        config = events.config
        self._events = events
        self._context = context
        self._queue = subscription.queue
        self._publisher = PUBLISHERS[config.runtime]
        self._interval = config.kv_heartbeat_s if config.kv_heartbeat_s > 0 else None
        self._backoff = max(config.kv_heartbeat_backoff_s, config.kv_heartbeat_s)
        self._cursors: dict[int, int] = {}
        self._event_id = 0
        self._sample = 0
        self._last_record: Any = None
        self._last_sent = time.monotonic()
        self._idle_heartbeats = 0
        self._last: tuple[int, int] | None = None  # (rank, sequence) of the last batch

    async def run(self) -> None:
        tick = LOAD_TICK_S if self._interval is None else min(LOAD_TICK_S, self._interval)
        while True:
            try:
                async with asyncio.timeout(None if self._interval is None else tick):
                    item = await self._queue.get()
            except TimeoutError:
                await self._heartbeat()
                continue
            assert item is not None  # a lossy subscription is never dropped
            await self._forward(*item)

    async def _forward(self, rank: int, batch: Batch) -> None:
        cursor = self._cursors.get(rank)
        if cursor is not None and batch.sequence > cursor + 1:
            await _abort(
                self._context,
                grpc.StatusCode.DATA_LOSS,
                f"KV events of DP rank {rank} jumped from batch {cursor} to "
                f"{batch.sequence} and its publisher keeps no replay buffer; "
                "subscribe again from zero and rebuild",
            )
        self._cursors[rank] = batch.sequence
        message = common_pb2.KvEventBatch(
            sequence_number=batch.sequence,
            timestamp=batch.timestamp,
            events=self._events_of(batch),
            dp_rank=rank,
        )
        self._last = (rank, batch.sequence)
        self._idle_heartbeats = 0
        record = self._record(rank)
        if record is not None:
            message.load.CopyFrom(self._numbered(record, load_only=False))
        await self._write(message)

    def _events_of(self, batch: Batch) -> list[Any]:
        """The batch's events as the relay forwards the engine's, numbered on this stream."""
        publisher = self._publisher
        medium, group = publisher.medium, publisher.group_idx
        made: list[Any] = []
        if batch.cleared:
            made.append(cleared_event(self._next_id()))
        for block_hash in batch.removed:
            made.append(removed_event((block_hash,), self._next_id(), medium, group))
        stored = batch.stored
        if stored:
            runs = [stored] if publisher.runs else [[block] for block in stored]
            for run in runs:
                event = stored_event(run, batch.block_size, self._next_id(), medium, group)
                if publisher.spec_kind is not None:
                    event.stored.kv_cache_spec_kind = publisher.spec_kind
                made.append(event)
        return made

    def _next_id(self) -> int:
        self._event_id += 1
        return self._event_id

    def _record(self, rank: int) -> Any:
        source = self._events.load_source
        return source(rank) if source is not None else self._events.load_of(rank)

    def _numbered(self, current: Any, load_only: bool) -> Any:
        record = common_pb2.EngineLoad()
        record.CopyFrom(current)
        self._sample += 1
        record.sample = self._sample
        record.load_only = load_only
        if not load_only and self._sample > 1:
            for name in TELEMETRY:
                record.ClearField(name)
        self._last_record = current
        return record

    async def _heartbeat(self) -> None:
        """A load-only batch when the record moved or the stream has been quiet long
        enough; nothing before the first batch."""
        if self._last is None or self._interval is None:
            return
        rank, sequence = self._last
        current = self._record(rank)
        if current is None:
            return
        changed = self._last_record is None or load_changed(self._last_record, current)
        due = self._backoff if self._idle_heartbeats >= 2 else self._interval
        if not changed and time.monotonic() - self._last_sent < due:
            return
        self._idle_heartbeats = 0 if changed else self._idle_heartbeats + 1
        message = common_pb2.KvEventBatch(
            sequence_number=sequence, timestamp=time.time(), dp_rank=rank
        )
        message.load.CopyFrom(self._numbered(current, load_only=True))
        await self._write(message)

    async def _write(self, message: Any) -> None:
        await self._context.write(message)
        self._last_sent = time.monotonic()


async def _abort(
    context: ServicerContext[Any, Any], code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable")
