"""The prefix index's read side: what placement asks of it. The longest cached prefix of a
prompt on each slot of the candidate workers (`matched_tokens`, through `walk`), the hit
to expect there (`stored_tokens`), and each worker's slots, blocks and block sizes.

`KvLookup` reads the state the index (`index.KvIndex`, its one subclass) writes; apart
from a step of a cleared slot's purge and expired assumptions swept, it changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from gateway.kv.holders import Holders
from gateway.kv.prefix import Prefix
from gateway.kv.slots import Sharded, Slot, SlotState
from gateway.kv.walk import held_run, walk


class KvLookup:
    """The index's lookups, over the state `KvIndex` keeps."""

    block_size: int  # for assumed slots, and the default of exact ones
    _holders: Holders  # own key -> bitmask of slot ids, and the slot ids
    _slots: dict[Slot, SlotState]
    _workers: dict[str, dict[int, SlotState]]  # worker -> rank -> slot
    _total: int  # stored entries over every worker

    def block_sizes(self, workers: Iterable[str] | None = None) -> set[int]:
        """Distinct block sizes of the workers' slots (all slots' if None), and the
        configured one (a new slot's)."""
        sizes = {self.block_size}
        chosen = self._workers.values() if workers is None else map(self._workers.get, workers)
        for slots in chosen:
            if slots:
                sizes.update(s.block_size for s in slots.values())
        return sizes

    def matched_tokens(self, prefix: Prefix, workers: Sequence[str], now: float) -> dict[Slot, int]:
        """Tokens of the prompt's longest cached prefix on each slot of `workers`."""
        if self._holders.purging:
            self._holders.purge()
        wanted: dict[int, int] = {}  # block size -> mask of the candidate slots
        for worker in workers:
            slots = self._workers.get(worker)
            if not slots:
                continue
            for state in slots.values():
                if state.expiry.due(now):
                    self._holders.sweep(state, now)
                wanted[state.block_size] = wanted.get(state.block_size, 0) | state.bit
        matched: dict[Slot, int] = {}
        for size, mask in wanted.items():
            for slot_id, depth in walk(self._holders.keys.get0, prefix.hashes(size), mask):
                holder = self._holders.by_id[slot_id]
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
        return held_run(keys, copies, tokens // size) * size

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
