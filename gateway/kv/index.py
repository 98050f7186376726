"""The prefix index: for every block key (the gateway's own hash), the worker slots holding it.

A slot is (worker id, DP rank). Its blocks come two ways:
- **stored**, from the worker's KV events: the gateway hashes them from their token ids,
  chained to their parent; a map engine hash -> own key per slot lets a removal find what
  it removes. A slot that gets events is *exact*;
- **assumed**, from the gateway's own placements: the prompt blocks of every request it
  placed there, kept for a TTL and up to a capacity (oldest first out). For a worker
  without KV events that is all there is; for an exact slot it covers the time between
  placing a prompt and the worker's event saying it is stored (a burst sharing a new
  prefix follows the first request), and keeps a session where it was after an eviction
  (it is re-cached there, instead of spread to a second worker's cache). On an exact slot
  that memory steers placement but is never an expected hit (`stored_tokens`): counted as
  cached, it put the expectation 24% above what engines with small caches reported.

Layout, so that a lookup costs O(blocks of the prompt), never O(slots) or O(block sizes):
every slot has a small integer id and a bit; the index maps each block key to the bitmask
of the slots holding it. A lookup reads the prompt's first key in that map, then finds each
candidate slot's depth by a bisection shared until the slots part (`walk`), once per
distinct block size of the candidate workers' slots. Per-worker slot lists keep `ranks`,
`size` and `exact` to the worker's own slots.

Worker input is bounded: at most `max_ranks` slots and `max_block_sizes` distinct block
sizes per worker (`admit` says why not), at most `max_blocks_per_worker` stored blocks per
worker and `max_blocks` in all (over a cap, the worker's oldest stored entries go first,
from its largest slot; over the total, the largest worker's).

Clearing a slot (a snapshot from 0, a worker gone) is immediate for lookups and for the
caps, but taking its bit off the holders of its blocks is O(its blocks): a large slot's
is done in steps (`purge`; `store_tokens` and `matched_tokens` each take one step too),
and its id is reused only once no key holds its bit any more.

The slots' structures are in `slots`, the key -> holders map and the slot ids in
`holders`, the lookup's walk through it in `walk`, what placement asks (the read side,
`KvLookup`) in `lookup`; this module is the index's API.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.kv.holders import PURGE_STEP, Holders
from gateway.kv.lookup import KvLookup
from gateway.kv.prefix import DEPTH_BITS, HASH_MASK, Prefix, as_tokens, extend, root
from gateway.kv.slots import SPREAD, Slot, SlotState

if TYPE_CHECKING:
    from gateway.config import KvConfig

# A placement remembers at most this many of the prompt's first blocks where it went
# (loop time per placement stays ~1-2 ms however long the prompt is).
ASSUME_BLOCKS = 4096
# On a slot with KV events, at most this many past what its events show stored: they say
# the rest within milliseconds. The memory steers a burst sharing a new prefix in that
# window, and keeps a session where it went after an eviction; 32 blocks of a new prefix
# (512 tokens of 16) set that worker apart from every other, which holds none of them.
# Each block remembered is a write into two big maps (~2 us on a slow host): a prompt of
# 121 new blocks spent ~290 us remembering them, a placement's slowest part by far.
PENDING_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class StoredBlock:
    engine_hash: int
    tokens: Sequence[int]


class KvIndex(KvLookup):
    """The index: its writes (stored, removed, cleared, assumed) and caps; what
    placement asks of it is `KvLookup`'s."""

    def __init__(
        self,
        block_size: int = 16,
        ttl_s: float = 120.0,
        capacity: int = 100_000,
        pending_ttl_s: float = 120.0,
        *,
        max_blocks_per_worker: int = 250_000,
        max_blocks: int = 2_000_000,
        max_ranks: int = 256,
        max_block_sizes: int = 4,
        share_window_s: float = 10.0,
    ):
        self.block_size = block_size  # for assumed slots, and the default of exact ones
        self.ttl_s = ttl_s
        self.pending_ttl_s = pending_ttl_s
        self.capacity = capacity  # assumed blocks per slot
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_blocks = max_blocks
        self.max_ranks = max_ranks
        self.max_block_sizes = max_block_sizes
        self._holders = Holders(capacity)  # own key -> bitmask of slot ids, and the slot ids
        self._slots: dict[Slot, SlotState] = {}
        self._workers: dict[str, dict[int, SlotState]] = {}  # worker -> rank -> slot
        self._stored: dict[str, int] = {}  # worker -> stored entries (engine hashes)
        self._total = 0
        self.evicted = 0  # stored entries dropped by the caps
        self.share_window_s = share_window_s
        self._placements: dict[str, tuple[float, float]] = {}  # worker -> (decayed, at)
        # Told each placement's assumed blocks (the shared store's follower, with `state:`).
        self.on_assume: Callable[[Slot, int, Sequence[int], int | None], object] | None = None

    @classmethod
    def from_config(cls, kv: KvConfig) -> KvIndex:
        return cls(
            kv.block_size,
            kv.assume_ttl_s,
            kv.assume_capacity,
            kv.pending_ttl_s,
            max_blocks_per_worker=kv.max_blocks_per_worker,
            max_blocks=kv.max_blocks,
            max_ranks=kv.max_ranks,
            max_block_sizes=kv.max_block_sizes,
            share_window_s=kv.share_window_s,
        )

    # -- slots -------------------------------------------------------------------------

    def admit(self, slot: Slot, block_size: int | None = None) -> str | None:
        """Why the slot (with that block size) may not be indexed, or None if it may."""
        slots = self._workers.get(slot[0], {})
        if slot[1] not in slots and len(slots) >= self.max_ranks:
            return "ranks"
        if block_size:
            sizes = {s.block_size for s in slots.values() if s.slot != slot}
            if block_size not in sizes and len(sizes) >= self.max_block_sizes:
                return "block_sizes"
        return None

    def _new_slot(self, slot: Slot, block_size: int, exact: bool) -> SlotState:
        state = self._holders.new_slot(slot, block_size, exact)
        self._slots[slot] = state
        self._workers.setdefault(slot[0], {})[slot[1]] = state
        return state

    # -- exact: from KV events ---------------------------------------------------------

    def follow(self, slot: Slot) -> None:
        """The slot's worker streams KV events: nothing is assumed about it any more."""
        self._exact(slot)

    def knows(self, slot: Slot, engine_hash: int) -> bool:
        state = self._slots.get(slot)
        return state is not None and engine_hash in state.engine_to_own

    def _exact(self, slot: Slot, block_size: int | None = None) -> SlotState | None:
        state = self._slots.get(slot)
        if state is None or not state.exact:
            if self.admit(slot, block_size) is not None:
                return None
            if state is not None:
                self.clear(slot)  # guesses made before the events started go
            state = self._new_slot(slot, block_size or self.block_size, exact=True)
        if block_size and block_size != state.block_size:
            if self.admit(slot, block_size) is not None:
                return None
            state.block_size = block_size
        return state

    def store(
        self,
        slot: Slot,
        blocks: Iterable[StoredBlock],
        parent_engine_hash: int | None,
        namespace: str = "",
        block_size: int | None = None,
    ) -> int:
        """Blocks stored on a slot, parent before child; returns how many were new. A
        block whose token count is not the block size ends the chain there."""
        state = self._exact(slot, block_size)
        if state is None:
            return 0
        size = state.block_size
        good: list[StoredBlock] = []
        for block in blocks:
            if len(block.tokens) != size:
                break
            good.append(block)
        if not good:
            return 0
        tokens = np.concatenate([as_tokens(b.tokens) for b in good])
        engine = [b.engine_hash for b in good]
        return self.store_tokens(slot, engine, tokens, parent_engine_hash, namespace, block_size)

    def store_tokens(
        self,
        slot: Slot,
        engine_hashes: Sequence[int],
        tokens: Any,
        parent_engine_hash: int | None,
        namespace: str = "",
        block_size: int | None = None,
    ) -> int:
        """`store` for blocks given as their engine hashes and their tokens end to end
        (len(engine_hashes) x block size of them)."""
        if self._holders.purging:
            self.purge()
        state = self._exact(slot, block_size)
        if state is None:
            return 0
        if parent_engine_hash is None:
            parent = root(namespace)
        else:
            # A parent the index never saw (stored on another tier, or before a gap):
            # its children still get entries, so their removal can be applied, but they
            # cannot match a prompt (the KV follower skips them before they get here).
            known = state.engine_to_own.get(parent_engine_hash)
            if known is None:
                parent = hash(("kv-unknown", slot, parent_engine_hash)) & HASH_MASK
            else:
                parent = known
        keys = extend(parent, tokens, state.block_size)
        added = entries = 0
        # Sharded maps, inlined (this loop runs once per stored block).
        engine_parts, engine_mask = state.engine_to_own.parts, state.engine_to_own.mask
        copy_parts, copy_mask = state.copies.parts, state.copies.mask
        holder_parts, holder_mask = self._holders.keys.parts, self._holders.keys.mask
        bit, spread = state.bit, SPREAD
        for engine_hash, own in zip(engine_hashes, keys, strict=False):
            engine_part = engine_parts[((engine_hash * spread) >> 32) & engine_mask]
            if engine_hash in engine_part:
                continue
            engine_part[engine_hash] = own
            entries += 1
            mixed = own >> DEPTH_BITS
            copy_part = copy_parts[mixed & copy_mask]
            count = copy_part.get(own, 0)
            copy_part[own] = count + 1
            if not count:
                holder_part = holder_parts[mixed & holder_mask]
                holder_part[own] = holder_part.get(own, 0) | bit
                added += 1
        if entries:  # the caps count entries (physical blocks), copies included
            worker = slot[0]
            stored = self._stored[worker] = self._stored.get(worker, 0) + entries
            self._total += entries
            if stored > self.max_blocks_per_worker:
                self._evict_worker(worker, self.max_blocks_per_worker)
            if self._total > self.max_blocks:
                self._evict_total()
        return added

    def _evict_worker(self, worker: str, target: int) -> None:
        """Down to `target` stored blocks: the oldest entries first, of the worker's
        largest slot, then the next."""
        slots = self._workers.get(worker, {})
        while self._stored.get(worker, 0) > target:
            state = max(slots.values(), key=lambda s: len(s.engine_to_own), default=None)
            if state is None or not state.engine_to_own:
                return
            before = self._stored[worker]
            self.remove(state.slot, state.engine_to_own.oldest(before - target))
            self.evicted += before - self._stored.get(worker, 0)

    def _evict_total(self) -> None:
        target = self.max_blocks
        while self._total > target and self._stored:
            worker = max(self._stored, key=lambda w: self._stored[w])
            held = self._stored[worker]
            self._evict_worker(worker, max(0, held - (self._total - target)))
            if self._stored.get(worker, 0) >= held:
                return

    def remove(self, slot: Slot, engine_hashes: Iterable[int]) -> int:
        state = self._slots.get(slot)
        if state is None or not state.exact:
            return 0
        removed = entries = 0
        parts, mask, spread = state.engine_to_own.parts, state.engine_to_own.mask, SPREAD
        release = self._holders.release
        for engine_hash in engine_hashes:
            own = parts[((engine_hash * spread) >> 32) & mask].pop(engine_hash, None)
            if own is not None:
                entries += 1
                removed += release(state, own)
        if entries:
            self._stored[slot[0]] -= entries
            self._total -= entries
        return removed

    def clear(self, slot: Slot) -> None:
        """The slot holds nothing from now on (for lookups and the caps); its keys are
        unheld now if it is small, else step by step (`purge`)."""
        state = self._slots.pop(slot, None)
        if state is None:
            return
        entries = len(state.engine_to_own)
        if entries:
            self._stored[slot[0]] -= entries
            self._total -= entries
        slots = self._workers.get(slot[0])
        if slots is not None:
            slots.pop(slot[1], None)
            if not slots:
                del self._workers[slot[0]]
                self._stored.pop(slot[0], None)
        self._holders.retire(state)

    def purge(self, budget: int = PURGE_STEP) -> bool:
        """Up to `budget` keys of cleared slots unheld; True while some are left."""
        return self._holders.purge(budget)

    @property
    def purging(self) -> bool:
        return self._holders.purging

    def drop_worker(self, worker_id: str) -> None:
        self._placements.pop(worker_id, None)
        for state in list(self._workers.get(worker_id, {}).values()):
            self.clear(state.slot)

    # -- assumed: from the gateway's own placements ------------------------------------

    def assume(
        self,
        slot: Slot,
        prefix: Prefix,
        now: float,
        kv_tokens: int | None = None,
        block_size: int | None = None,
        stored: int = 0,
    ) -> None:
        """The prompt's blocks will be cached on the slot: the gateway just sent it there.
        Until the worker's events say so (or for good, if it has none). `kv_tokens`: the
        worker's cache size, if it reports one (see `stored_tokens`); `block_size`: its
        block size, if it reports one (else `kv.block_size`); `stored`: the prompt's
        tokens `stored_tokens` found stored there (a slot with events: those blocks are
        not walked again, its events keep them, and at most PENDING_BLOCKS past them are
        remembered). `on_assume` hears it, on a worker without KV events."""
        state = self._assumable(slot, block_size)
        if state is None:
            return
        limit = min(self.capacity, ASSUME_BLOCKS)
        skip, end = 0, limit
        if state.exact:
            skip = min(stored // state.block_size, limit)
            end = min(limit, skip + PENDING_BLOCKS)
        hashes = prefix.hashes(state.block_size)[skip:end]
        self._assume(state, hashes, now, kv_tokens)
        if self.on_assume is not None and hashes and not state.exact:
            # Workers with KV events tell every gateway themselves, within milliseconds.
            self.on_assume(slot, state.block_size, hashes, kv_tokens)

    def assumed(
        self,
        slot: Slot,
        block_size: int,
        hashes: Sequence[int],
        now: float,
        kv_tokens: int | None = None,
    ) -> None:
        """Another gateway sent a prompt of these blocks to the slot (what it learned,
        shared through the store): remembered as if this one had."""
        self.placed(slot[0], now)
        state = self._assumable(slot, block_size)
        if state is not None and state.block_size == block_size:
            self._assume(state, hashes[: min(self.capacity, ASSUME_BLOCKS)], now, kv_tokens)

    # -- placements: the balance guard's shares ---------------------------------------

    def share(self, worker_id: str, now: float) -> float:
        """The worker's recent placements, decaying by exp(-age / share_window_s): this
        gateway's, and with a shared store every other gateway's too (what the balance
        guard weighs, so replicas balance the fleet, not each its own calls)."""
        count, at = self._placements.get(worker_id, (0.0, now))
        return count * math.exp((at - now) / self.share_window_s)

    def placed(self, worker_id: str, now: float) -> None:
        """One more placement on the worker (by this gateway, or told by another)."""
        self._placements[worker_id] = (self.share(worker_id, now) + 1, now)

    def _assumable(self, slot: Slot, block_size: int | None) -> SlotState | None:
        state = self._slots.get(slot)
        if state is None:
            if self.admit(slot) is not None:
                return None
            state = self._new_slot(slot, block_size or self.block_size, exact=False)
        return state

    def _assume(
        self,
        state: SlotState,
        hashes: Sequence[int],
        now: float,
        kv_tokens: int | None,
    ) -> None:
        expires = now + (self.pending_ttl_s if state.exact else self.ttl_s)
        self._holders.assume(state, hashes, expires)
        if not state.exact and kv_tokens:
            state.model(hashes, min(self.capacity, kv_tokens // state.block_size))
