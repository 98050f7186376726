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
of the slots holding it. A lookup follows the prompt's keys through that map, ANDing the
masks (in C: map + accumulate + takewhile), once per distinct block size of the candidate
workers' slots, then finds each slot's depth by bisection. Per-worker slot lists keep
`ranks`, `size` and `exact` to the worker's own slots.

Worker input is bounded: at most `max_ranks` slots and `max_block_sizes` distinct block
sizes per worker (`admit` says why not), at most `max_blocks_per_worker` stored blocks per
worker and `max_blocks` in all (over a cap, the worker's oldest stored entries go first,
from its largest slot; over the total, the largest worker's).

Clearing a slot (a snapshot from 0, a worker gone) is immediate for lookups and for the
caps, but taking its bit off the holders of its blocks is O(its blocks): a large slot's
is done in steps (`purge`; `store_tokens` and `matched_tokens` each take one step too),
and its id is reused only once no key holds its bit any more.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, islice, takewhile
from operator import and_
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.kv.prefix import DEPTH_BITS, HASH_MASK, Prefix, as_tokens, extend, root

if TYPE_CHECKING:
    from gateway.config import KvConfig

Slot = tuple[str, int]  # (worker id, DP rank)

# Big dicts are split in shards: growing a dict of n entries copies all n at once (~90 ms
# at 700k entries, measured), a shard's only n/shards. The shard of a key is picked with
# a secret multiplier, so a worker choosing its engine hashes cannot fill one shard.
SHARD_BITS = 6  # the index's key -> holders map
SLOT_SHARD_BITS = 4  # a slot's maps
_SPREAD = secrets.randbits(32) | 1


# A placement remembers at most this many of the prompt's first blocks where it went
# (loop time per placement stays ~1-2 ms however long the prompt is).
ASSUME_BLOCKS = 4096
# A cleared slot's keys unheld at once, or per `purge` step (well under 1 ms of work).
PURGE_STEP = 512
STRIDE = 64  # long prompts are walked every STRIDE-th block, then exactly at the end


class Sharded:
    """A dict of int keys in 2**bits dicts; insertion order is kept per shard. Own keys
    (the gateway's hashes: random bits above the depth) pick their shard by those bits;
    `salted` maps (a worker's engine hashes) by a secret multiplier."""

    __slots__ = ("mask", "parts", "salted")

    def __init__(self, bits: int, salted: bool = False) -> None:
        self.mask = (1 << bits) - 1
        self.parts: list[dict[int, int]] = [{} for _ in range(1 << bits)]
        self.salted = salted

    def part(self, key: int) -> dict[int, int]:
        if self.salted:
            return self.parts[((key * _SPREAD) >> 32) & self.mask]
        return self.parts[(key >> DEPTH_BITS) & self.mask]

    def get(self, key: int, default: int | None = None) -> int | None:
        return self.part(key).get(key, default)

    def get0(self, key: int) -> int:
        return self.parts[(key >> DEPTH_BITS) & self.mask].get(key, 0)

    def __contains__(self, key: int) -> bool:
        return key in self.part(key)

    def __setitem__(self, key: int, value: int) -> None:
        self.part(key)[key] = value

    def __delitem__(self, key: int) -> None:
        del self.part(key)[key]

    def pop(self, key: int, default: int | None = None) -> int | None:
        return self.part(key).pop(key, default)

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def __bool__(self) -> bool:
        return any(self.parts)

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.parts)

    def oldest(self, count: int) -> list[int]:
        """About `count` of the oldest keys: the oldest of every shard in turn."""
        each = -(-count // len(self.parts))
        return [key for part in self.parts for key in islice(part, each)][: max(count, 0)]


@dataclass(eq=False, slots=True)
class SlotState:
    slot: Slot
    id: int
    bit: int
    block_size: int
    exact: bool
    # Engine hash -> own key, oldest first (the eviction order).
    engine_to_own: Sharded = field(default_factory=lambda: Sharded(SLOT_SHARD_BITS, salted=True))
    copies: Sharded = field(default_factory=lambda: Sharded(SLOT_SHARD_BITS))  # own -> copies
    # Assumed blocks: own key -> expiry (monotonic), oldest (= soonest to expire) first.
    expiry: OrderedDict[int, float] = field(default_factory=OrderedDict)
    # Without events, with the worker's cache size known: the blocks a cache of that size
    # would hold after the gateway's placements (least recently sent first; a prompt's
    # tail before its root, as engines evict). The expected hit only, never placement.
    modelled: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.copies) if self.exact else len(self.expiry)

    def holds(self, own: int) -> bool:
        return own in self.copies or own in self.expiry


@dataclass(frozen=True, slots=True)
class StoredBlock:
    engine_hash: int
    tokens: Sequence[int]


def _alive(masks: Iterable[int], mask: int) -> list[int]:
    """alive[k]: the slots of `mask` in each of the first k masks (k=0: all), up to
    the first empty one (accumulate and takewhile run in C)."""
    return list(takewhile(bool, accumulate(masks, and_, initial=mask)))


def _held(masks: Iterable[int], bit: int) -> int:
    """How many of the first masks have `bit`."""
    count = 0
    for mask in masks:
        if not mask & bit:
            break
        count += 1
    return count


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        mask ^= low
        yield low


def _depth(alive: list[int], bit: int) -> int:
    """Blocks the slot with `bit` holds from the root: `alive` shrinks as k grows."""
    lo, hi = 1, len(alive)
    while lo < hi:
        mid = (lo + hi) // 2
        if alive[mid] & bit:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


class KvIndex:
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
    ):
        self.block_size = block_size  # for assumed slots, and the default of exact ones
        self.ttl_s = ttl_s
        self.pending_ttl_s = pending_ttl_s
        self.capacity = capacity  # assumed blocks per slot
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_blocks = max_blocks
        self.max_ranks = max_ranks
        self.max_block_sizes = max_block_sizes
        self._holders = Sharded(SHARD_BITS)  # own key -> bitmask of slot ids
        self._slots: dict[Slot, SlotState] = {}
        self._workers: dict[str, dict[int, SlotState]] = {}  # worker -> rank -> slot
        self._by_id: list[SlotState | None] = []
        self._free: list[int] = []
        self._purging: deque[Iterator[None]] = deque()  # cleared slots' unholding, stepped
        self._stored: dict[str, int] = {}  # worker -> stored entries (engine hashes)
        self._total = 0
        self.evicted = 0  # stored entries dropped by the caps

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
        if self._free:
            sid = self._free.pop()
        else:
            sid = len(self._by_id)
            self._by_id.append(None)
        state = SlotState(slot, sid, 1 << sid, block_size, exact)
        self._by_id[sid] = state
        self._slots[slot] = state
        self._workers.setdefault(slot[0], {})[slot[1]] = state
        return state

    def block_sizes(self, workers: Iterable[str] | None = None) -> set[int]:
        """Distinct block sizes of the workers' slots (all slots' if None), and the
        configured one (a new slot's)."""
        sizes = {self.block_size}
        chosen = self._workers.values() if workers is None else map(self._workers.get, workers)
        for slots in chosen:
            if slots:
                sizes.update(s.block_size for s in slots.values())
        return sizes

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
        if self._purging:
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
        holder_parts, holder_mask = self._holders.parts, self._holders.mask
        bit, spread = state.bit, _SPREAD
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
        parts, mask, spread = state.engine_to_own.parts, state.engine_to_own.mask, _SPREAD
        release = self._release
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
        self._by_id[state.id] = None
        steps = self._unholding(state)
        if len(state.copies) + len(state.expiry) <= PURGE_STEP:
            deque(steps, maxlen=0)
        else:
            self._purging.append(steps)

    def _unholding(self, state: SlotState) -> Iterator[None]:
        """A cleared slot's bit off each key it held, one key a step; then its id is free
        (no key holds its bit: a new slot with it inherits nothing). Nothing writes to a
        cleared slot's maps, so they are walked as they are."""
        holders, keep = self._holders, ~state.bit
        for own in chain(state.copies, state.expiry):
            mask = holders.get(own)
            if mask is not None:
                mask &= keep
                if mask:
                    holders[own] = mask
                else:
                    del holders[own]
            yield
        self._free.append(state.id)

    def purge(self, budget: int = PURGE_STEP) -> bool:
        """Up to `budget` keys of cleared slots unheld; True while some are left."""
        purging = self._purging
        while purging and budget > 0:
            done = sum(1 for _ in islice(purging[0], budget))
            if done < budget:
                purging.popleft()  # that slot is done (its id freed)
            budget -= max(done, 1)
        return bool(purging)

    @property
    def purging(self) -> bool:
        return bool(self._purging)

    def drop_worker(self, worker_id: str) -> None:
        for state in list(self._workers.get(worker_id, {}).values()):
            self.clear(state.slot)

    def _release(self, state: SlotState, own: int) -> int:
        part = state.copies.parts[(own >> DEPTH_BITS) & state.copies.mask]
        copies = part.get(own, 0) - 1
        if copies > 0:
            part[own] = copies
            return 0
        part.pop(own, None)
        if own not in state.expiry:  # a placement made since is still remembered
            self._unhold(state, own)
        return 1

    def _unhold(self, state: SlotState, own: int) -> None:
        mask = self._holders.get(own)
        if mask is not None:
            mask &= ~state.bit
            if mask:
                self._holders[own] = mask
            else:
                del self._holders[own]

    # -- assumed: from the gateway's own placements ------------------------------------

    def assume(
        self,
        slot: Slot,
        prefix: Prefix,
        now: float,
        kv_tokens: int | None = None,
        block_size: int | None = None,
    ) -> None:
        """The prompt's blocks will be cached on the slot: the gateway just sent it there.
        Until the worker's events say so (or for good, if it has none). `kv_tokens`: the
        worker's cache size, if it reports one (see `stored_tokens`); `block_size`: its
        block size, if it reports one (else `kv.block_size`)."""
        state = self._slots.get(slot)
        if state is None:
            if self.admit(slot) is not None:
                return
            state = self._new_slot(slot, block_size or self.block_size, exact=False)
        expires = now + (self.pending_ttl_s if state.exact else self.ttl_s)
        expiry, bit = state.expiry, state.bit
        copy_parts, copy_mask = state.copies.parts, state.copies.mask
        holder_parts, holder_mask = self._holders.parts, self._holders.mask
        hashes = prefix.hashes(state.block_size)
        limit = min(self.capacity, ASSUME_BLOCKS)
        if len(hashes) > limit:
            hashes = hashes[:limit]
        for own in hashes:
            mixed = own >> DEPTH_BITS
            if own in copy_parts[mixed & copy_mask]:
                continue
            if own in expiry:
                expiry.move_to_end(own)
            else:
                holder_part = holder_parts[mixed & holder_mask]
                holder_part[own] = holder_part.get(own, 0) | bit
            expiry[own] = expires
        while len(expiry) > self.capacity:
            self._forget(state, next(iter(expiry)))
        if not state.exact and kv_tokens:
            self._model(state, hashes, min(self.capacity, kv_tokens // state.block_size))

    @staticmethod
    def _model(state: SlotState, hashes: Sequence[int], blocks: int) -> None:
        """The prompt went into a cache of `blocks`: its blocks most recent, the root last."""
        modelled = state.modelled
        for own in reversed(hashes):
            modelled[own] = None
            modelled.move_to_end(own)
        while len(modelled) > blocks:
            modelled.popitem(last=False)

    def _forget(self, state: SlotState, own: int) -> None:
        del state.expiry[own]
        if own not in state.copies:
            self._unhold(state, own)

    def _sweep(self, state: SlotState, now: float) -> None:
        """Expired assumptions go (the oldest expire first: one TTL per slot)."""
        expiry = state.expiry
        while expiry:
            own, expires = next(iter(expiry.items()))
            if expires >= now:
                return
            self._forget(state, own)

    # -- lookup ------------------------------------------------------------------------

    def matched_tokens(self, prefix: Prefix, workers: Sequence[str], now: float) -> dict[Slot, int]:
        """Tokens of the prompt's longest cached prefix on each slot of `workers`."""
        if self._purging:
            self.purge()
        wanted: dict[int, int] = {}  # block size -> mask of the candidate slots
        for worker in workers:
            slots = self._workers.get(worker)
            if not slots:
                continue
            for state in slots.values():
                if state.expiry:
                    self._sweep(state, now)
                wanted[state.block_size] = wanted.get(state.block_size, 0) | state.bit
        matched: dict[Slot, int] = {}
        for size, mask in wanted.items():
            for slot_id, depth in self._walk(prefix.hashes(size), mask):
                holder = self._by_id[slot_id]
                if holder is not None:
                    matched[holder.slot] = depth * size
        return matched

    def stored_tokens(self, prefix: Prefix, slot: Slot, tokens: int) -> int:
        """Of the `tokens` of the prompt matched on `slot` (`matched_tokens`), those the
        worker's own KV events show stored: the hit to expect there. Placement memory
        steers placement (a burst, a session after an eviction, goes back where it went)
        but is no cached token: a request still in its prefill has stored nothing yet,
        and what an eviction event removed is computed again. On a slot without events,
        what a cache of the worker's reported size would still hold of the prompt after
        the gateway's placements (the engine's evictions are not seen, but its size is
        known); without that, the placements are all there is: all `tokens`. Engines
        (vLLM, SGLang) compute at least the prompt's last token, so a prompt matched
        whole is a hit of all its blocks but the one that holds that token."""
        state = self._slots.get(slot)
        size = state.block_size if state is not None else self.block_size
        tokens = min(tokens, max(0, len(prefix) - 1) // size * size)
        if state is None or tokens <= 0:
            return tokens
        copies: Sharded | OrderedDict[int, None]
        if state.exact:
            copies = state.copies
        elif state.modelled:
            copies = state.modelled
        else:
            return tokens
        keys = prefix.hashes(size)
        # The end of the stored chain by bisection, a few lookups however long the
        # prompt: engines evict a chain from its tail, so what the events show stored
        # of a prompt is a run from its root.
        lo, hi = 0, min(len(keys), tokens // size)
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in copies:
                lo = mid + 1
            else:
                hi = mid
        return lo * size

    def _walk(self, keys: list[int], mask: int) -> Iterator[tuple[int, int]]:
        """(slot id, blocks held from the root) for each slot of `mask` holding the
        first block. Up to 2 x STRIDE blocks, every block is looked up; past that, every
        STRIDE-th, then every block of the stride where a slot's chain ends (a hole in
        the middle of a chain a slot holds on both sides goes unseen: engines evict
        chains from the tail)."""
        get = self._holders.get0
        if len(keys) <= 2 * STRIDE:
            alive = _alive(map(get, keys), mask)
            for bit in _bits(alive[1] if len(alive) > 1 else 0):
                yield bit.bit_length() - 1, _depth(alive, bit)
            return
        head = _alive(map(get, keys[:STRIDE]), mask)
        through = head[STRIDE] if len(head) > STRIDE else 0
        for bit in _bits(head[1] if len(head) > 1 else 0):
            if not through & bit:
                yield bit.bit_length() - 1, _depth(head, bit)
        if not through:
            return
        # coarse[k]: slots holding the blocks at depths STRIDE, 2 STRIDE, ..., k STRIDE.
        coarse = _alive(map(get, keys[STRIDE - 1 :: STRIDE]), through)
        for bit in _bits(through):
            chunk = _depth(coarse, bit)  # whole strides held
            start = chunk * STRIDE
            tail = keys[start : start + STRIDE]
            extra = _held(map(get, tail), bit)
            yield bit.bit_length() - 1, start + extra

    def ranks(self, worker_id: str) -> int:
        """Data-parallel ranks the worker's KV events have shown (1 if none)."""
        return max(1, len(self._workers.get(worker_id, ())))

    def size(self, worker_id: str) -> int:
        """Blocks indexed for a worker, over its ranks."""
        return sum(len(s) for s in self._workers.get(worker_id, {}).values())

    def exact(self, worker_id: str) -> bool:
        return any(s.exact for s in self._workers.get(worker_id, {}).values())

    def total(self) -> int:
        """Stored (exact) blocks over every worker."""
        return self._total
