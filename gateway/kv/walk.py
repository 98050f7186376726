"""The lookup's walk: a prompt's block keys followed through the holders' bitmasks, the
masks ANDed in C (map + accumulate + takewhile), each slot's depth found by bisection."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, takewhile
from operator import and_
from typing import Protocol

STRIDE = 64  # long prompts are walked every STRIDE-th block, then exactly at the end


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


def walk(get: Callable[[int], int], keys: list[int], mask: int) -> Iterator[tuple[int, int]]:
    """(slot id, blocks held from the root) for each slot of `mask` holding the
    first block. Up to 2 x STRIDE blocks, every block is looked up; past that, every
    STRIDE-th, then every block of the stride where a slot's chain ends (a hole in
    the middle of a chain a slot holds on both sides goes unseen: engines evict
    chains from the tail). `get`: the mask of the slots holding a key (0 if none)."""
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
