"""One worker's KV event batches applied to the prefix index: a cursor per DP rank (a
duplicate skipped, a gap raised for the follower to subscribe again), each batch's load
record, and its events decoded, checked and stored.

A worker's events are untrusted input:
- a message is decoded and applied in pieces (`CHUNK_BYTES` of events at a time) that
  yield to the event loop once `SLICE_S` of work has been done, for as long as the work
  took (a flood gets at most half of the loop);
- a stored block whose token count is not its block size, a chain whose parent the slot
  does not hold, a rank or block size past the caps (`kv.max_ranks`,
  `kv.max_block_sizes`) and load figures out of range are skipped and counted (as
  `rejected_*` kinds of `gateway_kv_events_total`); a cap refusal is logged once.

How the batches arrive is the follower's (kv_events.py: a `KvBatches` with its
subscription); what a batch does to the index is here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import structlog
from smg_grpc_proto.generated import common_pb2

from gateway.config import KvConfig
from gateway.core.wire import payload, records
from gateway.engines.base import block_size_ok
from gateway.kv.blocks import namespace_of, on_device
from gateway.kv.index import KvIndex
from gateway.upstream.signals.load import LoadReport, kept_good

log = structlog.get_logger("gateway.kv")

CHUNK_BYTES = 1024  # events (or stored blocks) decoded at once: well under 1 ms of work
SLICE_S = 0.002  # work between two yields to the event loop
SCAN_TICK = 512  # records scanned between two looks at the clock


class Followed(Protocol):
    """What the follower reads of a worker, and tells it (`gateway.upstream.worker.Worker`)."""

    @property
    def load(self) -> LoadReport | None: ...

    def reported(self, report: LoadReport) -> None:
        """Every batch's load record."""

    @property
    def id(self) -> str: ...

    @property
    def inflight(self) -> int: ...


class Gap(Exception):
    """A batch's sequence skipped ahead of the cursor: some batches never arrived."""


class TooLarge(Exception):
    """A KV event message over `kv.max_event_bytes` (on a channel that let it through)."""


class Clock:
    """Yields to the event loop once SLICE_S of work has been done since the last yield,
    for as long as the work took (a big batch takes at most half of the loop's time: what
    else is ready runs at once instead of after every slice)."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def tick(self) -> None:
        busy = time.perf_counter() - self._since
        if busy >= SLICE_S:
            await asyncio.sleep(busy)
            self._since = time.perf_counter()


class KvBatches:
    """Applies one worker's batches to `index`; `on_report` is called after every load
    record (a fresh report may leave room)."""

    def __init__(
        self,
        worker: Followed,
        index: KvIndex,
        settings: KvConfig,
        on_report: Callable[[], None] = lambda: None,
    ) -> None:
        self.worker = worker
        self._on_report = on_report
        self.index = index
        self.settings = settings
        self.cursors: dict[int, int] = {}
        self.events: dict[str, int] = {}  # by kind: stored, removed, cleared, rejected_*
        self._loads: dict[int, tuple[int, int, float]] = {}
        self._warned: set[str] = set()
        self._in_order = 0  # batches applied in order since the last subscription
        self._ranks: set[int] = set()

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        """One batch, at once: its load record, then its events if they are the next
        ones (`apply_raw` is the same in slices)."""
        slot = self._head(batch)
        if slot is None:
            return
        for event in batch.events:
            self._event(slot, event)
        self._done(slot, batch.sequence_number)

    async def apply_raw(self, raw: bytes) -> None:
        """One serialized batch, decoded and applied in pieces that yield to the loop."""
        if len(raw) > self.settings.max_event_bytes:
            raise TooLarge(len(raw))
        head: list[bytes] = []
        events: list[tuple[int, int]] = []
        clock = Clock()
        for n, (number, _, start, end) in enumerate(records(raw, 0, len(raw))):
            if number == 3:
                events.append((start, end))
            else:
                head.append(raw[start:end])
            if not n % SCAN_TICK:
                await clock.tick()
        batch = common_pb2.KvEventBatch.FromString(b"".join(head))
        slot = self._head(batch)
        if slot is None:
            return
        piece: list[bytes] = []
        size = 0
        for start, end in events:
            if end - start > CHUNK_BYTES:
                await self._events(slot, piece, clock)
                piece, size = [], 0
                await self._large_event(slot, raw, start, end, clock)
                continue
            piece.append(raw[start:end])
            size += end - start
            if size >= CHUNK_BYTES:
                await self._events(slot, piece, clock)
                piece, size = [], 0
        await self._events(slot, piece, clock)
        self._done(slot, batch.sequence_number)

    async def _events(self, slot: tuple[str, int], piece: list[bytes], clock: Clock) -> None:
        if not piece:
            return
        for event in common_pb2.KvEventBatch.FromString(b"".join(piece)).events:
            self._event(slot, event)
        await clock.tick()

    async def _large_event(
        self, slot: tuple[str, int], raw: bytes, start: int, end: int, clock: Clock
    ) -> None:
        """One event bigger than a piece: a stored event's blocks go a piece at a time."""
        body = payload(raw, start)
        stored_at = None
        for number, _, first, last in records(raw, body, end):
            if number == 2:
                stored_at = (payload(raw, first), last)
        if stored_at is None:  # removed (packed hashes decode fast) or cleared
            self._event(slot, common_pb2.KvCacheEvent.FromString(raw[body:end]))
            await clock.tick()
            return
        self.events["stored"] = self.events.get("stored", 0) + 1
        head: list[bytes] = []
        edges: list[int] = []  # start, end of each block record (ints: no GC work)
        for n, (number, _, first, last) in enumerate(records(raw, *stored_at)):
            if number == 1:
                edges += (first, last)
            else:
                head.append(raw[first:last])
            if not n % SCAN_TICK:
                await clock.tick()  # the header may follow the blocks: a first pass
        stored = common_pb2.KvBlocksStored.FromString(b"".join(head))
        parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
        piece: list[bytes] = []
        size = 0
        for index in range(0, len(edges), 2):
            first, last = edges[index], edges[index + 1]
            piece.append(raw[first:last])
            size += last - first
            if size >= CHUNK_BYTES or index == len(edges) - 2:
                part = common_pb2.KvBlocksStored.FromString(b"".join(piece)).blocks
                piece, size = [], 0
                parent = self._store(slot, stored, part, parent)
                await clock.tick()
                if parent is None:
                    return  # the chain broke: the rest has no known parent

    def _head(self, batch: common_pb2.KvEventBatch) -> tuple[str, int] | None:
        """The batch's slot if its events are to be applied (after its load record);
        None to skip it; raises Gap when batches are missing."""
        rank = batch.dp_rank if batch.HasField("dp_rank") else 0
        slot = (self.worker.id, rank)
        if rank not in self._ranks:
            if rank < 0 or len(self._ranks) >= self.index.max_ranks or self.index.admit(slot):
                self._reject("rank", f"DP ranks past kv.max_ranks ({self.index.max_ranks})")
                return None
            self._ranks.add(rank)
        if batch.HasField("load"):
            self._load(rank, batch.load)
            if batch.load.load_only:
                return None
        sequence = batch.sequence_number
        cursor = self.cursors.get(rank)
        if batch.HasField("snapshot"):
            if batch.snapshot.index == 0:
                self.index.clear(slot)
        elif cursor is not None:
            if sequence <= cursor:
                return None  # seen already (a replay overlapping what arrived)
            if sequence != cursor + 1:
                raise Gap
        self.index.follow(slot)
        return slot

    def _done(self, slot: tuple[str, int], sequence: int) -> None:
        self.cursors[slot[1]] = sequence
        self._in_order += 1

    def _event(self, slot: tuple[str, int], event: common_pb2.KvCacheEvent) -> None:
        kind = event.WhichOneof("data") or "unknown"
        self.events[kind] = self.events.get(kind, 0) + 1
        if kind == "stored":
            stored = event.stored
            parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
            self._store(slot, stored, stored.blocks, parent)
        elif kind == "removed":
            removed = event.removed
            if on_device(removed.tier, removed.cache_level, removed.locality):
                self.index.remove(slot, removed.block_hashes)
        elif kind == "cleared":
            self.index.clear(slot)
            self.index.follow(slot)

    def _store(
        self,
        slot: tuple[str, int],
        stored: common_pb2.KvBlocksStored,
        blocks: Sequence[common_pb2.KvBlock],
        parent: int | None,
    ) -> int | None:
        """Validated blocks into the index; returns the engine hash of the last block
        stored (the parent of what follows), None if the chain broke."""
        if not blocks:
            return parent
        level = blocks[0].cache_level
        if not on_device(stored.tier, level, stored.locality):
            return None
        size = blocks[0].block_size or self.settings.block_size
        if not block_size_ok(size):
            self._reject("tokens", count=len(blocks))
            return None
        if self.index.admit(slot, size) == "block_sizes":
            limit = self.index.max_block_sizes
            self._reject("block_size", f"block sizes past kv.max_block_sizes ({limit})")
            return None
        if parent is not None and not self.index.knows(slot, parent):
            self._reject("parent", count=len(blocks))
            return None
        hashes: list[int] = []
        ids: list[int] = []
        for block in blocks:  # one pass: a wrapper object per block, and no more
            tokens = block.token_ids
            if len(tokens) != size or (block.block_size or size) != size:
                break
            hashes.append(block.block_hash)
            ids += tokens
        good = len(hashes)
        if good < len(blocks):
            self._reject("tokens", count=len(blocks) - good)
        if not good:
            return None
        array = np.array(ids, dtype=np.uint32)
        self.index.store_tokens(slot, hashes, array, parent, namespace_of(stored), size)
        if not self.index.knows(slot, hashes[-1]):
            return None  # refused by the index (a cap)
        return hashes[-1] if good == len(blocks) else None

    def _reject(self, reason: str, warning: str = "", count: int = 1) -> None:
        kind = f"rejected_{reason}"
        self.events[kind] = self.events.get(kind, 0) + count
        if warning and reason not in self._warned:
            self._warned.add(reason)  # once per worker: the count says the rest
            log.warning("kv_events_refused", worker=self.worker.id, reason=warning)

    def _load(self, rank: int, load: common_pb2.EngineLoad) -> None:
        """The worker's load, summed over its ranks, as fresh as its last batch; figures
        out of range keep the rank's previous ones (counted)."""
        figures = (load.running_requests, load.waiting_requests, load.token_usage)
        (running, waiting, usage), bad = kept_good(figures, self._loads.get(rank))
        if bad:
            self._reject("load", count=bad)
        self._loads[rank] = (running, waiting, usage)
        loads = self._loads.values()
        previous = self.worker.load
        self.worker.reported(
            LoadReport(
                running=min(LoadReport.MAX_REQUESTS, sum(x[0] for x in loads)),
                waiting=min(LoadReport.MAX_REQUESTS, sum(x[1] for x in loads)),
                token_usage=max(x[2] for x in loads),
                at=time.monotonic(),
                own=self.worker.inflight,
                rejected=(previous.rejected if previous is not None else 0) + bad,
                kv_tokens=previous.kv_tokens if previous is not None else None,
            )
        )
        self._on_report()  # a fresh report may leave room: whoever waits hears it
