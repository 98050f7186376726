"""A prompt as the prefix index sees it: chained hashes of its full token blocks.

The gateway hashes token ids itself, so the engine's hash function does not matter; the
namespace (LoRA, cache salt) seeds the chain, so two namespaces that share token ids never
share a block.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

TOKEN = "I"  # token ids are uint32 on the wire
WIDTH = array(TOKEN).itemsize


def root(namespace: str) -> int:
    """The chain's seed for a namespace ("" is the base model with no salt)."""
    return hash(("kv-root", namespace))


def chain(parent: int, tokens: Sequence[int]) -> int:
    """One block's hash: its tokens as bytes (hashed in C), chained to its parent's."""
    return hash((parent, array(TOKEN, tokens).tobytes()))


def block_hashes(tokens: Sequence[int], block_size: int, namespace: str) -> list[int]:
    """The hash of every full block of `tokens`, each chained to the one before (the
    prompt is packed once; each block is then a bytes slice: no per-token Python work)."""
    packed = array(TOKEN, tokens).tobytes()
    step = block_size * WIDTH
    hashes: list[int] = []
    parent = root(namespace)
    for start in range(0, len(packed) - step + 1, step):
        parent = hash((parent, packed[start : start + step]))
        hashes.append(parent)
    return hashes


class Prefix:
    """One request's prompt; its block hashes are computed once per block size asked."""

    __slots__ = ("_hashes", "expected_cached", "namespace", "ranks", "tokens")

    def __init__(self, tokens: Sequence[int], namespace: str = "") -> None:
        self.tokens = tokens
        self.namespace = namespace
        self._hashes: dict[int, list[int]] = {}
        # Set by cache-aware placement: the prompt tokens the index expects the chosen
        # worker to have cached (the last placement's, when a request is retried).
        self.expected_cached: int | None = None
        # Data-parallel workers: the rank whose cache holds the prompt, per worker, so
        # the request names it (`data_parallel_rank`) instead of leaving it to chance.
        self.ranks: dict[str, int] = {}

    def hashes(self, block_size: int) -> list[int]:
        found = self._hashes.get(block_size)
        if found is None:
            found = self._hashes[block_size] = block_hashes(self.tokens, block_size, self.namespace)
        return found

    def __len__(self) -> int:
        return len(self.tokens)
