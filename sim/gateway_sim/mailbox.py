"""Values left for another party under a key, which that party may wait for.

The bootstrap rooms, the vLLM KV handoffs and the received embedding parts all work
this way: one side puts, the other waits (bounded) and takes; whatever nobody takes
expires, as a real engine frees KV nobody fetched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

DEFAULT_TTL_S = 30.0


class Mailbox(Generic[T]):
    """Expiring values by key; ``wait`` blocks until a key's value is there (and ready)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._ttl_s = ttl_s
        # Insertion order is expiry order (``put`` re-inserts), so purging stops early.
        self._values: dict[str, tuple[float, T]] = {}
        # Replaced on every put: waiters wake, re-check their own key, sleep again.
        self._changed = asyncio.Event()
        self.waiting = 0

    def __len__(self) -> int:
        self._purge()
        return len(self._values)

    def put(self, key: str, value: T) -> None:
        self._purge()
        self._values.pop(key, None)
        self._values[key] = (time.monotonic() + self._ttl_s, value)
        self._changed.set()
        self._changed = asyncio.Event()

    def peek(self, key: str) -> T | None:
        self._purge()
        entry = self._values.get(key)
        return None if entry is None else entry[1]

    def take(self, key: str) -> T | None:
        self._purge()
        entry = self._values.pop(key, None)
        return None if entry is None else entry[1]

    async def wait(
        self, key: str, timeout_s: float, ready: Callable[[T], bool] | None = None
    ) -> T | None:
        """The value once present and ``ready``; after ``timeout_s`` whatever is there
        (possibly not ready, or None). Does not take it."""
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    value = self.peek(key)
                    if value is not None and (ready is None or ready(value)):
                        return value
                    await self._changed.wait()
        except TimeoutError:
            return self.peek(key)
        finally:
            self.waiting -= 1

    def _purge(self) -> None:
        now = time.monotonic()
        while self._values:
            key, (expires, _) = next(iter(self._values.items()))
            if expires > now:
                return
            del self._values[key]
