"""A slot's structures: its state (its id and bit, what it stores and is assumed to hold)
and the sharded dicts it and the index's holders map are made of."""

from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Generic, TypeVar

from gateway.kv.prefix import DEPTH_BITS

Slot = tuple[str, int]  # (worker id, DP rank)

# Big dicts are split in shards: growing a dict of n entries copies all n at once (~90 ms
# at 700k entries, measured), a shard's only n/shards. The shard of a key is picked with
# a secret multiplier, so a worker choosing its engine hashes cannot fill one shard.
SHARD_BITS = 6  # the index's key -> holders map
SLOT_SHARD_BITS = 4  # a slot's maps
SPREAD = secrets.randbits(32) | 1
D = TypeVar("D", bound=dict[int, int] | dict[int, float])


class Parts(Generic[D]):
    """Int keys kept in several dicts (`parts`): their length, truth and keys as one."""

    __slots__ = ("mask", "parts")

    def __init__(self, parts: list[D]) -> None:
        self.mask = len(parts) - 1
        self.parts = parts

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def __bool__(self) -> bool:
        return any(self.parts)

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.parts)


class Sharded(Parts[dict[int, int]]):
    """A dict of int keys in 2**bits dicts; insertion order is kept per shard. Own keys
    (the gateway's hashes: random bits above the depth) pick their shard by those bits;
    `salted` maps (a worker's engine hashes) by a secret multiplier."""

    __slots__ = ("salted",)

    def __init__(self, bits: int, salted: bool = False) -> None:
        super().__init__([{} for _ in range(1 << bits)])
        self.salted = salted

    def part(self, key: int) -> dict[int, int]:
        if self.salted:
            return self.parts[((key * SPREAD) >> 32) & self.mask]
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

    def oldest(self, count: int) -> list[int]:
        """About `count` of the oldest keys: the oldest of every shard in turn."""
        each = -(-count // len(self.parts))
        return [key for part in self.parts for key in islice(part, each)][: max(count, 0)]


MIN_SHARE = 1024  # a slot's assumed blocks are split when each part holds this many


class Expiry(Parts["OrderedDict[int, float]"]):
    """A slot's assumed blocks: own key -> when the assumption expires, oldest (= soonest
    to expire: one TTL per slot) first, in 2**SLOT_SHARD_BITS ordered maps by the key's bits,
    each holding at most its `share` of the capacity. One ordered map of 100,000 keys
    rebuilds itself in one go as it grows: 6-20 ms of the event loop, measured; one of a
    sixteenth of that takes a sixteenth of the time. Keys spread evenly (their bits above
    the depth are random), so each map's oldest are about the slot's oldest; a small
    capacity keeps one map, its order exact."""

    __slots__ = ("oldest", "share")

    def __init__(self, capacity: int) -> None:
        bits = SLOT_SHARD_BITS if capacity >= MIN_SHARE << SLOT_SHARD_BITS else 0
        super().__init__([OrderedDict() for _ in range(1 << bits)])
        self.share = -(-capacity // len(self.parts))
        # At most the soonest expiry held (none: inf), so a lookup that finds nothing due
        # costs one comparison, not a look at every part.
        self.oldest = math.inf

    def due(self, now: float) -> bool:
        """Whether some assumption may have expired by `now`."""
        return self.oldest < now

    def part(self, own: int) -> OrderedDict[int, float]:
        return self.parts[(own >> DEPTH_BITS) & self.mask]

    def __contains__(self, own: int) -> bool:
        return own in self.part(own)

    def __delitem__(self, own: int) -> None:
        del self.part(own)[own]


@dataclass(eq=False, slots=True)
class SlotState:
    slot: Slot
    id: int
    bit: int
    block_size: int
    exact: bool
    expiry: Expiry  # assumed blocks: own key -> expiry (monotonic)
    # Engine hash -> own key, oldest first (the eviction order).
    engine_to_own: Sharded = field(default_factory=lambda: Sharded(SLOT_SHARD_BITS, salted=True))
    copies: Sharded = field(default_factory=lambda: Sharded(SLOT_SHARD_BITS))  # own -> copies
    # Without events, with the worker's cache size known: the blocks a cache of that size
    # would hold after the gateway's placements (least recently sent first; a prompt's
    # tail before its root, as engines evict). The expected hit only, never placement.
    modelled: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.copies) if self.exact else len(self.expiry)

    def model(self, hashes: Sequence[int], blocks: int) -> None:
        """The prompt went into a cache of `blocks`: its blocks most recent, the root last."""
        modelled = self.modelled
        for own in reversed(hashes):
            modelled[own] = None
            modelled.move_to_end(own)
        while len(modelled) > blocks:
            modelled.popitem(last=False)
