"""Which slots hold each block key: a bitmask of slot ids per key, the slots by id, and
the ids free for a new slot; a slot letting go of a key, and a cleared slot's bit taken
off its keys, at once or in steps (`purge`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import chain, islice

from gateway.kv.prefix import DEPTH_BITS
from gateway.kv.slots import SHARD_BITS, Expiry, Sharded, Slot, SlotState

# A cleared slot's keys unheld at once, or per `purge` step (well under 1 ms of work).
PURGE_STEP = 512


class Holders:
    """The key -> holders map and the slot ids its masks are made of: an id is reused
    only once no key holds its bit any more."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # assumed blocks per slot
        self.keys = Sharded(SHARD_BITS)  # own key -> bitmask of slot ids
        self.by_id: list[SlotState | None] = []
        self.free: list[int] = []
        self._purging: deque[Iterator[None]] = deque()  # cleared slots' unholding, stepped

    def __len__(self) -> int:
        """Keys some slot holds."""
        return len(self.keys)

    def new_slot(self, slot: Slot, block_size: int, exact: bool) -> SlotState:
        if self.free:
            sid = self.free.pop()
        else:
            sid = len(self.by_id)
            self.by_id.append(None)
        state = SlotState(slot, sid, 1 << sid, block_size, exact, Expiry(self.capacity))
        self.by_id[sid] = state
        return state

    def retire(self, state: SlotState) -> None:
        """A cleared slot: its keys unheld now if it is small, else step by step."""
        self.by_id[state.id] = None
        steps = self._unholding(state)
        if len(state.copies) + len(state.expiry) <= PURGE_STEP:
            deque(steps, maxlen=0)
        else:
            self._purging.append(steps)

    def _unholding(self, state: SlotState) -> Iterator[None]:
        """A cleared slot's bit off each key it held, one key a step; then its id is free
        (no key holds its bit: a new slot with it inherits nothing). Nothing writes to a
        cleared slot's maps, so they are walked as they are."""
        holders, keep = self.keys, ~state.bit
        for own in chain(state.copies, state.expiry):
            mask = holders.get(own)
            if mask is not None:
                mask &= keep
                if mask:
                    holders[own] = mask
                else:
                    del holders[own]
            yield
        self.free.append(state.id)

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

    def release(self, state: SlotState, own: int) -> int:
        part = state.copies.parts[(own >> DEPTH_BITS) & state.copies.mask]
        copies = part.get(own, 0) - 1
        if copies > 0:
            part[own] = copies
            return 0
        part.pop(own, None)
        if own not in state.expiry:  # a placement made since is still remembered
            self.unhold(state, own)
        return 1

    def unhold(self, state: SlotState, own: int) -> None:
        mask = self.keys.get(own)
        if mask is not None:
            mask &= ~state.bit
            if mask:
                self.keys[own] = mask
            else:
                del self.keys[own]

    def assume(self, state: SlotState, hashes: Sequence[int], expires: float) -> None:
        """The slot holds `hashes` until `expires`, at most `capacity` assumed blocks (the
        oldest out, per part of its expiry map). A block the slot's events show stored is
        remembered as placed too (looking it up among the stored blocks would cost a cold
        read a block, a third of the cost): that only keeps it held until the assumption
        expires. A key is in the expiry map only while the slot's bit is in its mask, so a
        key without the bit is new there: one read of the holders' map, not two."""
        expiry, bit = state.expiry, state.bit
        expiry_parts, expiry_mask = expiry.parts, expiry.mask
        holder_parts, holder_mask = self.keys.parts, self.keys.mask
        for own in hashes:
            mixed = own >> DEPTH_BITS
            part = expiry_parts[mixed & expiry_mask]
            holder_part = holder_parts[mixed & holder_mask]
            mask = holder_part.get(own, 0)
            if not mask & bit:
                holder_part[own] = mask | bit
            elif own in part:
                part.move_to_end(own)
            part[own] = expires
        expiry.oldest = min(expiry.oldest, expires)  # what it held expires sooner, if any
        share = expiry.share
        for part in expiry_parts:
            while len(part) > share:
                self.forget(state, next(iter(part)))

    def sweep(self, state: SlotState, now: float) -> None:
        """Expired assumptions go (the oldest expire first: one TTL per slot)."""
        expiry = state.expiry
        oldest = math.inf
        for part in expiry.parts:
            while part:
                own, expires = next(iter(part.items()))
                if expires >= now:
                    oldest = min(oldest, expires)
                    break
                self.forget(state, own)
        expiry.oldest = oldest

    def forget(self, state: SlotState, own: int) -> None:
        del state.expiry[own]
        if own not in state.copies:
            self.unhold(state, own)
