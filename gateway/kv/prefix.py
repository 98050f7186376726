"""A prompt as the prefix index sees it: chained hashes of its full token blocks.

The gateway hashes token ids itself, so the engine's hash function does not matter; the
namespace (LoRA, cache salt) seeds the chain, so two namespaces that share token ids never
share a block. Prompts and KV events' stored blocks go through the same functions here.

Hashing is vectorised (numpy), so its cost per token is a few nanoseconds of C, and long
prompts can be hashed in a thread (`Prefix.prepare`): numpy releases the GIL meanwhile.

A block's key packs its chain hash and its depth (blocks from the chain's root):
    key = H_d | d           (low DEPTH_BITS bits: d; bits above, up to KEY_BITS: H_d)
    H_d = H_0 + sum_{j<=d} W_j * content(block j)   (mod 2**KEY_BITS; W_j, H_0 multiples
                                                     of 2**DEPTH_BITS)
with secret weights W_j and per-position content keys (random at start-up, per process;
or, with a shared store, from a secret every gateway sharing it agrees on, `use_seed`, so
that what one learns another can look up): a cumulative sum, so a whole prompt's chain is
one numpy pass, and a child is one step from its parent's key. Keys stay below 2**60
(small Python ints). The secret keeps clients from choosing prompts whose keys collide.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.core.offload import Offload
from gateway.engines.tokens import TokenIds

DEPTH_BITS = 20
MAX_DEPTH = (1 << DEPTH_BITS) - 1  # blocks of one chain that are indexed; deeper ones are not
KEY_BITS = 60
HASH_MASK = ((1 << KEY_BITS) - 1) ^ MAX_DEPTH  # the chain-hash bits of a key
ANCHOR_TOKENS = 64  # a prompt's first tokens: they break ties between equal workers
THREAD_MIN_TOKENS = 16_384  # shorter prompts are hashed inline: a thread hop costs more

U64 = np.uint64
Keys = npt.NDArray[np.uint64]
_M1 = U64(0xBF58476D1CE4E5B9)
_M2 = U64(0x94D049BB133111EB)
_GOLDEN = U64(0x9E3779B97F4A7C15)
_SEED = secrets.randbits(64)  # per process: every index and prompt of this process agree
_KEYS_SEED = secrets.randbits(64)


def _mix(x: Keys) -> Keys:
    """splitmix64's finalizer, in place (uint64 arithmetic wraps)."""
    x ^= x >> U64(30)
    x *= _M1
    x ^= x >> U64(27)
    x *= _M2
    x ^= x >> U64(31)
    return x


def _mix_int(value: int) -> int:
    x = np.array([value & 0xFFFFFFFFFFFFFFFF], dtype=U64)
    return int(_mix(x)[0])


class _Tables:
    """Depth weights and per-position content keys, grown on demand (deterministic from
    the seeds, so two threads growing them at once compute the same values)."""

    weights: Keys = np.zeros(0, dtype=U64)
    positions: dict[int, Keys] = {}

    @classmethod
    def weights_upto(cls, depth: int) -> Keys:
        table = cls.weights
        if len(table) <= depth:
            size = min(MAX_DEPTH + 1, max(1024, 2 * (depth + 1)))
            table = _mix(np.arange(size, dtype=U64) + U64(_SEED))
            table &= U64(HASH_MASK)
            cls.weights = table
        return table

    @classmethod
    def position_keys(cls, block_size: int) -> Keys:
        keys = cls.positions.get(block_size)
        if keys is None:
            base = U64((_KEYS_SEED + block_size * 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)
            keys = cls.positions[block_size] = _mix(np.arange(block_size, dtype=U64) + base)
        return keys


def as_tokens(tokens: Any) -> npt.NDArray[np.uint32]:
    """Token ids as a uint32 array (a protobuf repeated field converts in C)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32:
        return tokens
    return np.asarray(tokens, dtype=np.uint32)


def contents(tokens: npt.NDArray[np.uint32], block_size: int) -> Keys:
    """One content hash per full block of `tokens` (the tail that fills no block is left)."""
    blocks = len(tokens) // block_size
    x = tokens[: blocks * block_size].reshape(blocks, block_size).astype(U64)
    x += _Tables.position_keys(block_size)
    x *= _GOLDEN
    x ^= x >> U64(29)
    sums = x.sum(axis=1, dtype=U64)
    sums += U64(block_size)
    return _mix(sums)


def extend(parent: int, tokens: Any, block_size: int) -> list[int]:
    """The keys of the full blocks of `tokens` chained after the block keyed `parent` (a
    root's key for a chain's first blocks); blocks deeper than MAX_DEPTH are left out."""
    depth = parent & MAX_DEPTH
    array = as_tokens(tokens)
    room = MAX_DEPTH - depth
    if len(array) > room * block_size:
        array = array[: room * block_size]
    content = contents(array, block_size)
    n = len(content)
    if not n:
        return []
    weights = _Tables.weights_upto(depth + n)[depth + 1 : depth + n + 1]
    chain = np.cumsum(content * weights, dtype=U64)
    chain += U64(parent & HASH_MASK)
    chain &= U64(HASH_MASK)
    chain |= np.arange(depth + 1, depth + n + 1, dtype=U64)
    keys: list[int] = chain.tolist()
    return keys


def root(namespace: str) -> int:
    """The chain's seed for a namespace ("" is the base model with no salt): depth 0
    (the same in every process that uses the same seed)."""
    named = hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8)
    return _mix_int(int.from_bytes(named.digest(), "big") ^ _SEED) & HASH_MASK


def use_seed(secret: bytes) -> None:
    """Derive every key from `secret` from now on (gateways sharing a store agree on one);
    called once at start-up, before any prompt or KV event is hashed."""
    global _SEED, _KEYS_SEED
    derived = hashlib.blake2b(secret, digest_size=16, person=b"gateway-kv-keys").digest()
    _SEED, _KEYS_SEED = int.from_bytes(derived[:8], "big"), int.from_bytes(derived[8:], "big")
    _Tables.weights = np.zeros(0, dtype=U64)
    _Tables.positions = {}


def seed_tag() -> bytes:
    """8 bytes that differ between seeds (not the seed): messages keyed by another seed
    are told apart."""
    both = (_SEED << 64 | _KEYS_SEED).to_bytes(16, "big")
    return hashlib.blake2b(both, digest_size=8, person=b"gateway-kv-tag").digest()


def chain(parent: int, tokens: Sequence[int]) -> int:
    """One block's key, chained after its parent's (the block is all of `tokens`)."""
    keys = extend(parent, tokens, len(tokens))
    return keys[0] if keys else parent


def block_hashes(tokens: Any, block_size: int, namespace: str) -> list[int]:
    """The key of every full block of `tokens`, each chained to the one before."""
    return extend(root(namespace), tokens, block_size)


class Prefix:
    """One request's prompt; its block hashes are computed once per block size asked."""

    __slots__ = ("_hashes", "namespace", "tokens")

    def __init__(self, tokens: TokenIds, namespace: str = "") -> None:
        self.tokens = tokens
        self.namespace = namespace
        self._hashes: dict[int, list[int]] = {}

    def anchor(self) -> str | None:
        """A key of the prompt's first ANCHOR_TOKENS tokens and namespace, the same in
        every process and gateway (no secret: it only breaks ties between workers that
        cost the same, so a client gains nothing by choosing it); None for no tokens."""
        head = as_tokens(self.tokens[:ANCHOR_TOKENS])
        if not len(head):
            return None
        named = head.tobytes() + self.namespace.encode("utf-8", "surrogatepass")
        return hashlib.blake2b(named, digest_size=8).hexdigest()

    def hashes(self, block_size: int) -> list[int]:
        found = self._hashes.get(block_size)
        if found is None:
            found = self._hashes[block_size] = block_hashes(self.tokens, block_size, self.namespace)
        return found

    def compute(self, block_sizes: Iterable[int]) -> None:
        """Hash for each block size not hashed yet (what `prepare` runs in a thread)."""
        array: npt.NDArray[np.uint32] | None = None
        start = root(self.namespace)
        for size in block_sizes:
            if size > 0 and size not in self._hashes:
                if array is None:
                    array = as_tokens(self.tokens)
                self._hashes[size] = extend(start, array, size)

    async def prepare(self, block_sizes: Iterable[int], offload: Offload) -> None:
        """Hash ahead of placement, on `offload`'s thread for a long prompt, so the
        (synchronous) placement that follows only looks the keys up."""
        missing = [s for s in set(block_sizes) if s > 0 and s not in self._hashes]
        if not missing:
            return
        if len(self.tokens) < THREAD_MIN_TOKENS:
            self.compute(missing)
        else:
            await offload.run(self.compute, missing)

    def __len__(self) -> int:
        return len(self.tokens)
