"""The prefix index: for every block hash (the gateway's own), the worker slots holding it.

A slot is (worker id, DP rank). Its blocks come two ways:
- **stored**, from the worker's KV events: the gateway hashes them from their token ids,
  chained to their parent; a map engine hash -> own hash per slot lets a removal find what
  it removes. A slot that gets events is *exact*;
- **assumed**, from the gateway's own placements: the prompt blocks of every request it
  placed there, kept for a TTL and up to a capacity (oldest first out). For a worker
  without KV events that is all there is; for an exact slot it covers the time between
  placing a prompt and the worker's event saying it is stored (a burst sharing a new
  prefix follows the first request), and keeps a session where it was after an eviction
  (it is re-cached there, instead of spread to a second worker's cache).

Lookups follow the prompt's own blocks (no scan of the index), so routing cost grows with
the prompt's length, never with what the fleet has cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.kv.prefix import Prefix, chain, root

Slot = tuple[str, int]  # (worker id, DP rank)


@dataclass(slots=True)
class SlotState:
    block_size: int
    exact: bool
    engine_to_own: dict[int, int] = field(default_factory=dict)
    copies: dict[int, int] = field(default_factory=dict)  # own hash -> physical copies
    # Assumed slots: own hash -> expiry (monotonic), oldest first.
    expiry: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.copies) if self.exact else len(self.expiry)

    def holds(self, own: int) -> bool:
        return own in self.copies or own in self.expiry


@dataclass(frozen=True, slots=True)
class StoredBlock:
    engine_hash: int
    tokens: Sequence[int]


class KvIndex:
    def __init__(
        self,
        block_size: int = 16,
        ttl_s: float = 120.0,
        capacity: int = 100_000,
        pending_ttl_s: float = 120.0,
    ):
        self.block_size = block_size  # for assumed slots, and the default of exact ones
        self.ttl_s = ttl_s
        self.pending_ttl_s = pending_ttl_s
        self.capacity = capacity  # assumed blocks per slot
        self._holders: dict[int, set[Slot]] = {}
        self._slots: dict[Slot, SlotState] = {}

    # -- exact: from KV events ---------------------------------------------------------

    def follow(self, slot: Slot) -> None:
        """The slot's worker streams KV events: nothing is assumed about it any more."""
        self._exact(slot)

    def _exact(self, slot: Slot, block_size: int | None = None) -> SlotState:
        state = self._slots.get(slot)
        if state is None or not state.exact:
            if state is not None:
                self.clear(slot)  # guesses made before the events started go
            state = self._slots[slot] = SlotState(block_size or self.block_size, exact=True)
        if block_size:
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
        """Blocks stored on a slot, parent before child; returns how many were new."""
        state = self._exact(slot, block_size)
        if parent_engine_hash is None:
            parent = root(namespace)
        else:
            # A parent the index never saw (stored on another tier, or before a gap):
            # its children still get entries, so their removal can be applied, but they
            # cannot match a prompt.
            known = state.engine_to_own.get(parent_engine_hash)
            parent = hash(("kv-unknown", slot, parent_engine_hash)) if known is None else known
        added = 0
        for block in blocks:
            own = chain(parent, block.tokens)
            if block.engine_hash not in state.engine_to_own:
                state.engine_to_own[block.engine_hash] = own
                added += self._hold(state, slot, own)
            parent = own
        return added

    def remove(self, slot: Slot, engine_hashes: Iterable[int]) -> int:
        state = self._slots.get(slot)
        if state is None or not state.exact:
            return 0
        removed = 0
        for engine_hash in engine_hashes:
            own = state.engine_to_own.pop(engine_hash, None)
            if own is not None:
                removed += self._release(state, slot, own)
        return removed

    def clear(self, slot: Slot) -> None:
        state = self._slots.pop(slot, None)
        if state is None:
            return
        for own in {*state.copies, *state.expiry}:
            holders = self._holders.get(own)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._holders[own]

    def drop_worker(self, worker_id: str) -> None:
        for slot in [s for s in self._slots if s[0] == worker_id]:
            self.clear(slot)

    def _hold(self, state: SlotState, slot: Slot, own: int) -> int:
        copies = state.copies.get(own, 0)
        state.copies[own] = copies + 1
        if copies:
            return 0
        self._holders.setdefault(own, set()).add(slot)
        return 1

    def _release(self, state: SlotState, slot: Slot, own: int) -> int:
        copies = state.copies.get(own, 0) - 1
        if copies > 0:
            state.copies[own] = copies
            return 0
        state.copies.pop(own, None)
        if own not in state.expiry:  # a placement made since is still remembered
            self._unhold(slot, own)
        return 1

    def _unhold(self, slot: Slot, own: int) -> None:
        holders = self._holders.get(own)
        if holders is not None:
            holders.discard(slot)
            if not holders:
                del self._holders[own]

    # -- assumed: from the gateway's own placements ------------------------------------

    def assume(self, slot: Slot, prefix: Prefix, now: float) -> None:
        """The prompt's blocks will be cached on the slot: the gateway just sent it there.
        Until the worker's events say so (or for good, if it has none)."""
        state = self._slots.get(slot)
        if state is None:
            state = self._slots[slot] = SlotState(self.block_size, exact=False)
        expires = now + (self.pending_ttl_s if state.exact else self.ttl_s)
        copies, expiry, holders = state.copies, state.expiry, self._holders
        for own in prefix.hashes(state.block_size):
            if own in copies:
                continue
            if own in expiry:
                expiry.move_to_end(own)
            else:
                found = holders.get(own)
                if found is None:
                    holders[own] = {slot}
                else:
                    found.add(slot)
            expiry[own] = expires
        while len(state.expiry) > self.capacity:
            self._forget(state, slot, next(iter(state.expiry)))

    def _forget(self, state: SlotState, slot: Slot, own: int) -> None:
        del state.expiry[own]
        if own not in state.copies:
            self._unhold(slot, own)

    # -- lookup ------------------------------------------------------------------------

    def matched_tokens(self, prefix: Prefix, workers: Sequence[str], now: float) -> dict[Slot, int]:
        """Tokens of the prompt's longest cached prefix on each slot of `workers`."""
        matched: dict[Slot, int] = {}
        wanted = set(workers)
        sizes = {s.block_size for slot, s in self._slots.items() if slot[0] in wanted}
        for size in sizes:
            alive: set[Slot] | None = None
            for depth, own in enumerate(prefix.hashes(size), start=1):
                holders = self._holders.get(own)
                if not holders:
                    break
                here = {s for s in list(holders) if s[0] in wanted and self._fresh(s, own, now)}
                alive = here if alive is None else alive & here
                if not alive:
                    break
                for slot in alive:
                    matched[slot] = depth * size
        return matched

    def _fresh(self, slot: Slot, own: int, now: float) -> bool:
        state = self._slots[slot]
        if own in state.copies:
            return True
        expires = state.expiry.get(own)
        if expires is None:
            return False
        if expires < now:
            self._forget(state, slot, own)
            return False
        return True

    def ranks(self, worker_id: str) -> int:
        """Data-parallel ranks the worker's KV events have shown (1 if none)."""
        return max(1, sum(1 for slot in self._slots if slot[0] == worker_id))

    def size(self, worker_id: str) -> int:
        """Blocks indexed for a worker, over its ranks."""
        return sum(len(s) for slot, s in self._slots.items() if slot[0] == worker_id)

    def exact(self, worker_id: str) -> bool:
        return any(s.exact for slot, s in self._slots.items() if slot[0] == worker_id)
