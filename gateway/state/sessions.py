"""Session bindings every replica shares: a session stays on its worker whichever replica
takes its next call.

Before a call with a session is placed, its bindings (one per leg) are read from the store
and put in this process's table, so placement finds them as if this process had made them;
every binding placement makes is written back in the background, refreshing its expiry
(`affinity.ttl_s`). A key is a digest of (session, model, leg); a value is a worker id,
read back only if it is short text. While the store is away, each process keeps its own
bindings, as without a store."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from gateway.core.roles import Role
from gateway.placement.affinity import Affinity, Key
from gateway.state.store import MAX_WORKER_ID, Store, StoreAway, digest


class SharedSessions:
    """The store's session bindings, kept in step with one process's `Affinity`."""

    def __init__(self, affinity: Affinity, store: Store, ttl_s: float) -> None:
        self._affinity = affinity
        self._store = store
        self._ttl_ms = max(1, int(ttl_s * 1000))
        affinity.on_bind = self._bound

    def configure(self, ttl_s: float) -> None:
        """A reload: bindings written from now expire after `ttl_s`."""
        self._ttl_ms = max(1, int(ttl_s * 1000))

    def _key(self, key: Key) -> str:
        session, model, leg = key
        return self._store.key("session", digest(f"{session}\0{model}\0{leg.value}"))

    async def fetch(self, session: str, model: str, legs: Collection[Role]) -> None:
        """The session's bindings for the model, from the store into this process's table
        (the store's win); nothing changes if the store is away."""
        keys = [(session, model, leg) for leg in legs if leg is not Role.ENCODE]
        if not keys:
            return
        names = [self._key(key) for key in keys]
        try:
            found = await self._store.run("session_read", lambda client: client.mget(names))
        except StoreAway:
            return
        if not isinstance(found, list) or len(found) != len(keys):
            self._store.invalid("session_read", "an answer that is no list of values")
            return
        now = time.monotonic()
        table = self._affinity.table
        for key, value in zip(keys, found, strict=True):
            if value is None:
                continue
            if not isinstance(value, bytes) or not 0 < len(value) <= MAX_WORKER_ID:
                self._store.invalid("session_read", "a binding that is no worker id")
                continue
            table.bind(key, value.decode(errors="replace"), now)

    def _bound(self, key: Key, worker: str) -> None:
        name = self._key(key)

        async def write(client: Any) -> object:
            return await client.set(name, worker, px=self._ttl_ms)

        self._store.write("session_write", write)
