"""The lookup's walk: a prompt's block keys followed through the holders' bitmasks, the
masks ANDed in C (map + accumulate + takewhile), each slot's depth found by bisection."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, takewhile
from math import isqrt
from operator import and_
from typing import Protocol

MIN_STRIDE = 8  # a prompt is walked every stride-th block (at least this), then exactly


def stride_for(blocks: int) -> int:
    """The walk's stride for a prompt of `blocks`: about the square root of half of them,
    which makes the lookups (a stride of head, the sampled depths, a stride per holder's
    end) fewest for one or two holders. Each lookup is a cold read of a big map (~0.25 us,
    measured), so their count is the walk's cost."""
    return max(MIN_STRIDE, isqrt(blocks // 2))


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
    first block. Up to two strides (`stride_for`), every block is looked up; past that,
    a stride of head, then every stride-th block, then every block of the stride where a
    slot's chain ends (a hole shorter than a stride in the middle of a chain a slot holds
    on both sides goes unseen: engines evict chains from the tail). `get`: the mask of
    the slots holding a key (0 if none)."""
    stride = stride_for(len(keys))
    if len(keys) <= 2 * stride:
        alive = _alive(map(get, keys), mask)
        for bit in _bits(alive[1] if len(alive) > 1 else 0):
            yield bit.bit_length() - 1, _depth(alive, bit)
        return
    head = _alive(map(get, keys[:stride]), mask)
    through = head[stride] if len(head) > stride else 0
    for bit in _bits(head[1] if len(head) > 1 else 0):
        if not through & bit:
            yield bit.bit_length() - 1, _depth(head, bit)
    if not through:
        return
    # coarse[k]: slots holding the blocks at depths stride, 2 stride, ..., k stride.
    coarse = _alive(map(get, keys[stride - 1 :: stride]), through)
    for bit in _bits(through):
        chunk = _depth(coarse, bit)  # whole strides held
        start = chunk * stride
        tail = keys[start : start + stride]
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
