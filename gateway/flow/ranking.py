"""Tenants ranked by a key: a binary heap that knows where each tenant sits. The flow
queue ranks each class's tenants three ways with it (by their head's start tag, by their
head's age, by how many they have waiting), updated on every change, so that no
operation of the queue scans it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar


class Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


K = TypeVar("K", bound=Ordered)


def anyone(tenant: str) -> bool:
    return True


class Ranking(Generic[K]):
    """Tenants ranked by a key, each at most once: a binary heap that knows where each
    tenant sits, so `set` (add or re-key) and `discard` are O(log n), `first` O(1) when
    the top is eligible. `walk` yields in key order without changing anything, O(log j)
    for the j-th tenant yielded. Keys are unique (each ends in a request's seq)."""

    __slots__ = ("_items", "_keys", "_where")

    def __init__(self) -> None:
        self._keys: list[K] = []
        self._items: list[str] = []
        self._where: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def set(self, item: str, key: K) -> None:
        at = self._where.get(item)
        if at is None:
            self._keys.append(key)
            self._items.append(item)
            self._up(len(self._keys) - 1)
            return
        old = self._keys[at]
        self._keys[at] = key
        if key < old:
            self._up(at)
        elif old < key:
            self._down(at)

    def discard(self, item: str) -> None:
        at = self._where.pop(item, None)
        if at is None:
            return
        key, moved = self._keys.pop(), self._items.pop()
        if at < len(self._keys):
            self._keys[at], self._items[at] = key, moved
            self._down(self._up(at))

    def first(self, eligible: Callable[[str], bool] = anyone) -> str | None:
        """The first eligible tenant: O(1) if it is the top, else O(j log j) for the
        j ineligible tenants ranked ahead of it."""
        if self._items and eligible(self._items[0]):
            return self._items[0]
        return next((item for _, item in self.walk() if eligible(item)), None)

    def walk(self) -> Iterator[tuple[K, str]]:
        """(key, tenant) in key order: a best-first walk down the heap. Stop using it
        once the ranking changes."""
        keys = self._keys
        frontier: list[tuple[K, int]] = [(keys[0], 0)] if keys else []
        while frontier:
            key, at = heapq.heappop(frontier)
            yield key, self._items[at]
            for child in (2 * at + 1, 2 * at + 2):
                if child < len(keys):
                    heapq.heappush(frontier, (keys[child], child))

    def clear(self) -> None:
        self._keys.clear()
        self._items.clear()
        self._where.clear()

    def _up(self, at: int) -> int:
        keys, items, where = self._keys, self._items, self._where
        key, item = keys[at], items[at]
        while at > 0:
            parent = (at - 1) >> 1
            if not key < keys[parent]:
                break
            keys[at], items[at] = keys[parent], items[parent]
            where[items[at]] = at
            at = parent
        keys[at], items[at] = key, item
        where[item] = at
        return at

    def _down(self, at: int) -> None:
        keys, items, where = self._keys, self._items, self._where
        key, item = keys[at], items[at]
        while (child := 2 * at + 1) < len(keys):
            if child + 1 < len(keys) and keys[child + 1] < keys[child]:
                child += 1
            if not keys[child] < key:
                break
            keys[at], items[at] = keys[child], items[child]
            where[items[at]] = at
            at = child
        keys[at], items[at] = key, item
        where[item] = at
