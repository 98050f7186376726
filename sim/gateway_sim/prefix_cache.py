"""A simulated engine's prefix cache, one per DP rank: full blocks of prompt token ids,
chained, so a later prompt that starts the same way finds its prefix already computed.

A prompt's hit stops short of its last token, as both engines match it: the engine needs
that token's logits, so a prompt of exactly two blocks, both cached, is served one.

A block is identified by (namespace, parent block, its token ids): the namespace (the
request's LoRA) keeps two adapters apart even when their token ids agree, and the parent
makes a block stand for the whole prefix up to it. A trailing partial block is never
cached. Each block also gets the engine's own ``block_hash``, an int64 computed with a
per-process random seed and chained with the parent's, as the KV events publish it: a
subscriber must map those hashes, it cannot recompute them.

Blocks a running request uses are referenced and cannot be evicted. Over capacity, the
least recently used unreferenced block goes first. Every use touches a block's whole
path (leaf first on release), so an unreferenced block is always older than its own
unreferenced children and the oldest one is always a leaf: chains are evicted tail first
without ever searching for a leaf.

What changes is reported to a ``CacheListener`` (the KV event log), nothing else here
knows about protos.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

Key = tuple[str, "Block | None", tuple[int, ...]]


class Block:
    """One cached full block; identity is its ``key``, never its hash."""

    __slots__ = ("block_hash", "key", "parent", "refs")

    def __init__(self, key: Key, parent: Block | None, block_hash: int) -> None:
        self.key = key
        self.parent = parent
        self.block_hash = block_hash
        self.refs = 0

    @property
    def namespace(self) -> str:
        return self.key[0]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key[2]


class CacheListener(Protocol):
    """Where a cache reports its changes (one call per change set, in order)."""

    def changed(self, removed: Sequence[int], stored: Sequence[Block]) -> None:
        """``removed``: hashes evicted; ``stored``: a new run, parent before child."""

    def cleared(self) -> None:
        """Every block is gone (FlushCache)."""


def chain_hash(seed: bytes, parent: Block | None, namespace: str, tokens: Sequence[int]) -> int:
    """The engine's block hash: signed 64-bit, keyed with the process's random seed."""
    head = (
        b"root:" + namespace.encode() + b"\0"
        if parent is None
        else parent.block_hash.to_bytes(8, "little", signed=True)
    )
    digest = hashlib.blake2b(head + array("I", tokens).tobytes(), key=seed, digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


class Lease:
    """A request's hold on its cached path: the blocks it matched, then those it stored."""

    __slots__ = ("blocks", "cached_tokens", "epoch", "input_ids", "namespace")

    def __init__(
        self, namespace: str, input_ids: Sequence[int], blocks: list[Block], epoch: int, size: int
    ) -> None:
        self.namespace = namespace
        self.input_ids = input_ids
        self.blocks = blocks
        self.epoch = epoch
        self.cached_tokens = len(blocks) * size


class PrefixCache:
    """One DP rank's cache of ``capacity`` blocks of ``block_size`` tokens."""

    def __init__(
        self,
        block_size: int,
        capacity: int,
        seed: bytes,
        listener: CacheListener | None = None,
    ) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._seed = seed
        self._listener = listener
        # Insertion order puts every parent before its children: a child is created
        # after its parent and evicted before it.
        self._index: dict[Key, Block] = {}
        # Unreferenced blocks, least recently used first (always a leaf: see module doc).
        self._unused: OrderedDict[Block, None] = OrderedDict()
        self._referenced = 0
        self._epoch = 0  # bumped by flush: leases from before hold detached blocks

    def __len__(self) -> int:
        return len(self._index)

    @property
    def usage(self) -> float:
        """Blocks held, cached or in use, over capacity (at most 1)."""
        return min(len(self._index) / self.capacity, 1.0)

    @property
    def active_usage(self) -> float:
        """Blocks running requests hold (not evictable) over capacity (at most 1)."""
        return min(self._referenced / self.capacity, 1.0)

    def blocks(self) -> Iterator[Block]:
        """Live blocks, every parent before its children."""
        return iter(self._index.values())

    # --------------------------------------------------------------- per request

    def admit(self, namespace: str, input_ids: Sequence[int]) -> Lease:
        """Reference the longest cached run of full blocks the prompt starts with, short
        of its last token."""
        return Lease(
            namespace, input_ids, self._match(namespace, input_ids), self._epoch, self.block_size
        )

    def hit_tokens(self, lease: Lease) -> int:
        """What a request with this prompt would find cached now (its own blocks
        stored): the leased blocks, short of the prompt's last token."""
        usable = max(len(lease.input_ids) - 1, 0) // self.block_size
        return min(len(lease.blocks), usable) * self.block_size

    def store(self, lease: Lease) -> None:
        """The prefill is done: cache the prompt's remaining full blocks (referenced
        by the lease), evicting first if they do not fit."""
        if lease.epoch != self._epoch:  # flushed during the prefill: start from the root
            lease.blocks = self._match(lease.namespace, lease.input_ids)
            lease.epoch = self._epoch
        size = self.block_size
        ids = lease.input_ids
        end = len(ids) // size * size
        parent = lease.blocks[-1] if lease.blocks else None
        start = len(lease.blocks) * size
        index = self._index
        # Another request may have stored part of it meanwhile: take those, then the rest.
        while start < end:
            block = index.get((lease.namespace, parent, tuple(ids[start : start + size])))
            if block is None:
                break
            self._ref(block)
            lease.blocks.append(block)
            parent = block
            start += size
        if start >= end:
            return
        removed = self._evict(len(index) + (end - start) // size - self.capacity)
        stored: list[Block] = []
        for offset in range(start, end, size):
            tokens = tuple(ids[offset : offset + size])
            key = (lease.namespace, parent, tokens)
            block = Block(key, parent, chain_hash(self._seed, parent, lease.namespace, tokens))
            block.refs = 1
            index[key] = block
            stored.append(block)
            parent = block
        self._referenced += len(stored)
        lease.blocks.extend(stored)
        if self._listener is not None:
            self._listener.changed(removed, stored)

    def release(self, lease: Lease) -> None:
        """The request is over: its blocks become evictable once nobody else uses them."""
        blocks, lease.blocks = lease.blocks, []
        if lease.epoch != self._epoch:
            return  # flushed: those blocks are no longer cached
        unused = self._unused
        for block in reversed(blocks):  # leaf first: see the module docstring
            block.refs -= 1
            if block.refs == 0:
                unused[block] = None
                self._referenced -= 1
        if len(self._index) > self.capacity:
            removed = self._evict(len(self._index) - self.capacity)
            if removed and self._listener is not None:
                self._listener.changed(removed, ())

    def flush(self) -> None:
        """Drop every block, in use or not (running requests keep their KV: it is simply
        no longer shared)."""
        self._index.clear()
        self._unused.clear()
        self._referenced = 0
        self._epoch += 1
        if self._listener is not None:
            self._listener.cleared()

    # ------------------------------------------------------------------ internals

    def _match(self, namespace: str, ids: Sequence[int]) -> list[Block]:
        size = self.block_size
        index = self._index
        path: list[Block] = []
        parent: Block | None = None
        for start in range(0, max(len(ids) - 1, 0) // size * size, size):
            block = index.get((namespace, parent, tuple(ids[start : start + size])))
            if block is None:
                break
            path.append(block)
            parent = block
        for block in path:
            self._ref(block)
        return path

    def _ref(self, block: Block) -> None:
        if block.refs == 0:
            del self._unused[block]
            self._referenced += 1
        block.refs += 1

    def _evict(self, count: int) -> list[int]:
        """Evict up to ``count`` least recently used unreferenced blocks; their hashes."""
        removed: list[int] = []
        unused = self._unused
        while count > 0 and unused:
            block, _ = unused.popitem(last=False)
            del self._index[block.key]
            removed.append(block.block_hash)
            count -= 1
        return removed
