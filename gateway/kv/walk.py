"""The lookup's walk: each candidate slot's depth in a prompt's block keys, found by
bisection over the holders' bitmasks, the slots that part ways at a probe split in two
(engines evict a chain from its tail, so a slot holds a run from the root)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol


def walk(get: Callable[[int], int], keys: Sequence[int], mask: int) -> Iterator[tuple[int, int]]:
    """(slot id, depth) for every slot of `mask` that holds the prompt's first block:
    depth, the blocks it holds from the root. `get`: the mask of the slots holding a key
    (0 if none).

    One read of the root, then a bisection shared by the slots until they part: a slot
    that holds the probed block goes on above it, the others below. Each read is a cold
    read of a big map, so their count is the walk's cost: ~log2(blocks) a group of slots
    at one depth (8 at the median benchmark prompt of 132 blocks and one or two holders,
    against 30 for the strided walk this replaced), and never more than the blocks. A
    hole in the middle of a chain a slot holds on both sides may go unseen (a probe past
    it finds the slot): engines evict from the tail, and the expected hit
    (`KvLookup.stored_tokens`) assumes the same."""
    if not keys:
        return
    held = get(keys[0]) & mask
    if not held:
        return
    # (lo, hi, slots): these slots hold block lo - 1 and not block hi (or hi is the end).
    pending = [(1, len(keys), held)]
    while pending:
        lo, hi, slots = pending.pop()
        if lo >= hi:
            while slots:
                bit = slots & -slots
                slots ^= bit
                yield bit.bit_length() - 1, lo
            continue
        mid = (lo + hi) // 2
        above = get(keys[mid]) & slots
        if above:
            pending.append((mid + 1, hi, above))
        if slots ^ above:
            pending.append((lo, mid, slots ^ above))


class Keys(Protocol):
    def __contains__(self, key: int, /) -> bool: ...


def held_run(keys: Sequence[int], held: Keys, limit: int) -> int:
    """How many of the first `limit` keys `held` holds, as a run from the first, found by
    bisection (a few lookups however long the prompt)."""
    lo, hi = 0, min(len(keys), limit)
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo
