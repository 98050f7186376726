"""LoRA adapter affinity: which candidates a call for an adapter should go to.

A pure function of the candidates, the adapters each holds (least recently used first)
and the running calls per adapter on each: the workers holding the adapter; else those
with room for one more; else those where an adapter no running call uses can be
unloaded (the least recently used such one). The model's policy then chooses among
them, so cache-aware placement (whose prefix index keys the prompt by its adapter)
composes with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

W = TypeVar("W")

# How an engine adapter names a prompt's LoRA adapter in its KV-cache namespace.
NAMESPACE_PREFIX = "lora:"


def adapter_of(namespace: str) -> str:
    """The LoRA adapter a call names ("" for none), from its prompt's cache namespace."""
    return namespace[len(NAMESPACE_PREFIX) :] if namespace.startswith(NAMESPACE_PREFIX) else ""


@dataclass(frozen=True, slots=True)
class Holding:
    """What one worker holds: its adapters, least recently used first, and its running
    calls per adapter."""

    loaded: Sequence[str]
    in_use: Mapping[str, int]


class Tier(Enum):
    LOADED = "loaded"  # holds the adapter, or is loading it (calls for it run there)
    SPARE = "spare"  # can load it without unloading another
    EVICT = "evict"  # can load it after unloading an unused one
    FULL = "full"  # none can: every candidate is offered (the worker decides)


def evictable(holding: Holding, keep: str) -> str | None:
    """The least recently used adapter no running call uses (never `keep`)."""
    for name in holding.loaded:
        if name != keep and not holding.in_use.get(name):
            return name
    return None


def has_room(holding: Holding, max_loaded: int, adapter: str) -> bool:
    """Fewer than `max_loaded` adapters besides `adapter`, counting those being loaded
    (calls for them run there, not yet held)."""
    occupied = set(holding.loaded) | {name for name, calls in holding.in_use.items() if calls}
    occupied.discard(adapter)
    return len(occupied) < max_loaded


@dataclass(frozen=True, slots=True)
class Preferred(Generic[W]):
    workers: list[W]
    tier: Tier


def preferred(
    adapter: str, candidates: Sequence[W], holdings: Sequence[Holding], max_loaded: int
) -> Preferred[W]:
    """The candidates (with `holdings`, in the same order) a call for `adapter` should go
    to, and why."""
    pairs = list(zip(candidates, holdings, strict=True))
    for tier in (Tier.LOADED, Tier.SPARE, Tier.EVICT):
        found = [w for w, h in pairs if fits_tier(tier, h, adapter, max_loaded)]
        if found:
            return Preferred(found, tier)
    return Preferred(list(candidates), Tier.FULL)


def fits_tier(tier: Tier, holding: Holding, adapter: str, max_loaded: int) -> bool:
    if tier is Tier.LOADED:
        return adapter in holding.loaded or bool(holding.in_use.get(adapter))
    if tier is Tier.SPARE:
        return has_room(holding, max_loaded, adapter)
    if tier is Tier.EVICT:
        return evictable(holding, adapter) is not None
    return True
