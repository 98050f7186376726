"""What both KV event relays read: each DP rank's published batches (what its prefix
cache changed), numbered as the rank's publisher numbers them, fanned out to every
open subscription through a bounded queue.

A batch keeps what changed (the blocks themselves, which never change); each relay makes
its own protos from it, when a subscriber first needs them: with nobody subscribed, a
request that stores blocks costs no proto work at all.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from smg_grpc_proto.generated import common_pb2

from gateway_sim.prefix_cache import Block

if TYPE_CHECKING:
    from gateway_sim.config import SimConfig
    from gateway_sim.prefix_cache import PrefixCache

TIER = common_pb2.KV_CACHE_TIER_DEVICE
MEDIUM = "GPU"
LOCALITY = common_pb2.KV_CACHE_LOCALITY_LOCAL

LoadOf = Callable[[int], Any]  # rank -> a fresh common_pb2.EngineLoad, or None


def stored_event(
    blocks: Sequence[Block],
    block_size: int,
    event_id: int = 0,
    medium: str | None = MEDIUM,
    group_idx: int | None = None,
) -> Any:
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
        locality=LOCALITY,
    )
    if medium is not None:
        stored.medium = medium
    if group_idx is not None:
        stored.group_idx = group_idx
    if first.parent is not None:
        stored.parent_block_hash = first.parent.block_hash
    if first.namespace:
        stored.lora_name = first.namespace
    return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)


def removed_event(
    hashes: Sequence[int],
    event_id: int = 0,
    medium: str | None = MEDIUM,
    group_idx: int | None = None,
) -> Any:
    removed = common_pb2.KvBlocksRemoved(block_hashes=hashes, tier=TIER, locality=LOCALITY)
    if medium is not None:
        removed.medium = medium
    if group_idx is not None:
        removed.group_idx = group_idx
    return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)


def cleared_event(event_id: int = 0) -> Any:
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class Batch:
    """One published batch: what changed (``removed`` hashes, then a ``stored`` run, or
    ``cleared``), under the rank's sequence number. ``first_event_id`` numbers its
    events for the rust relay, which keeps them; a ``snapshot`` batch is the rust
    relay's own."""

    __slots__ = (
        "_events",
        "block_size",
        "cleared",
        "first_event_id",
        "removed",
        "sequence",
        "snapshot",
        "stored",
        "timestamp",
    )

    def __init__(
        self,
        sequence: int,
        timestamp: float,
        *,
        removed: Sequence[int] = (),
        stored: Sequence[Block] = (),
        cleared: bool = False,
        block_size: int = 0,
        first_event_id: int = 0,
        events: list[Any] | None = None,
        snapshot: Any = None,
    ) -> None:
        self.sequence = sequence
        self.timestamp = timestamp
        self.removed = removed
        self.stored = stored
        self.cleared = cleared
        self.block_size = block_size
        self.first_event_id = first_event_id
        self.snapshot = snapshot  # common_pb2.KvSnapshotChunk
        self._events = events

    @property
    def events(self) -> list[Any]:
        """The rust relay's events: removals in one event, the stored run in another,
        numbered from ``first_event_id``."""
        if self._events is None:
            made: list[Any] = []
            next_id = self.first_event_id
            if self.cleared:
                made.append(cleared_event(next_id))
                next_id += 1
            if self.removed:  # room is made before the new blocks go in
                made.append(removed_event(self.removed, next_id))
                next_id += 1
            if self.stored:
                made.append(stored_event(self.stored, self.block_size, next_id))
            self._events = made
        return self._events


class Subscription:
    """One open SubscribeKvEvents call's queue of live batches.

    Past ``size`` waiting batches, a ``lossy`` subscription loses the new ones (as a
    ZMQ subscriber past its high-water mark: the relay sees the gap later); any other is
    dropped whole (its stream ends when it next looks)."""

    def __init__(self, size: int, lossy: bool = False) -> None:
        self.size = size
        self.lossy = lossy
        # None: the subscriber fell too far behind and is dropped.
        self.queue: asyncio.Queue[tuple[int, Batch] | None] = asyncio.Queue(size)
        self.overflowed = False

    def offer(self, rank: int, batch: Batch) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait((rank, batch))
        except asyncio.QueueFull:
            if self.lossy:
                return
            # Let go of everything queued at once; the stream ends when it next looks.
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(None)


class RankLog:
    """One rank's publisher: its sequence (from ``first``), a bounded history (the rust
    relay's; ``history`` 0 keeps none) and the fan-out; the cache's listener."""

    def __init__(
        self,
        rank: int,
        history: int,
        block_size: int,
        subscriptions: set[Subscription],
        drop_rate: float = 0.0,
        first: int = 1,
        cleared_at_start: bool = False,
    ) -> None:
        self.rank = rank
        self.first = first
        self._pending_clear = cleared_at_start  # the first batch begins with `cleared`
        self._drop_rate = drop_rate
        self._rng = random.Random()
        self.sequence = first - 1  # the last published; below ``first``: none yet
        self.dropped_through = 0  # highest sequence no longer in history
        self._history: deque[Batch] = deque(maxlen=history)
        self._block_size = block_size
        self._event_ids = 0
        self._subscriptions = subscriptions

    @property
    def published(self) -> bool:
        return self.sequence >= self.first

    @property
    def history(self) -> deque[Batch]:
        return self._history

    def event_ids(self, count: int) -> int:
        """Allocate ``count`` event ids; the first."""
        first = self._event_ids + 1
        self._event_ids += count
        return first

    def changed(self, removed: Sequence[int], stored: Sequence[Block]) -> None:
        first_id = self.event_ids(bool(removed) + bool(stored))
        self._publish(
            Batch(
                0,
                0.0,
                removed=removed,
                stored=stored,
                block_size=self._block_size,
                first_event_id=first_id,
            )
        )

    def cleared(self) -> None:
        self._publish(Batch(0, 0.0, cleared=True, first_event_id=self.event_ids(1)))

    def _publish(self, batch: Batch) -> None:
        if self._pending_clear:
            self._pending_clear = False
            batch.cleared = True
        self.sequence += 1
        batch.sequence = self.sequence
        batch.timestamp = time.time()
        history = self._history
        if history.maxlen:
            if len(history) == history.maxlen:
                self.dropped_through = history[0].sequence
            history.append(batch)
        if self._drop_rate and self._rng.random() < self._drop_rate:
            return  # lost on the way (a rust relay's history still has it)
        for subscription in self._subscriptions:
            subscription.offer(self.rank, batch)


class KvSource(Protocol):
    """What a SubscribeKvEvents relay (relay_python, relay_rust) reads of the engine's KV
    events: met by kv_events.KvEvents, which picks the relay (the relays never import it)."""

    config: SimConfig
    load_of: LoadOf  # the rust relay's load record
    load_source: Callable[[int], Any] | None  # the python relay's, once the servicer set it
    logs: list[RankLog]
    caches: list[PrefixCache]

    def subscribe(self, subscription: Subscription) -> None: ...

    def unsubscribe(self, subscription: Subscription) -> None: ...
