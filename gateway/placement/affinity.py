"""Session affinity: a session's calls go, leg by leg, where its earlier calls went.

A call whose session header names a session (at most `MAX_SESSION_KEY` characters; a
longer value names none) asks placement for the worker bound to (session, model, leg);
placement takes it when it is among the leg's candidates (available, not failed in this
call, under its cluster's limits) and the policy accepts it, else places the leg afresh.
Either way, placement then binds the session to the worker the leg got (the one writer of
the table) and counts the outcome: `hit` (the bound worker), `miss` (no binding), `rebind`
(placed elsewhere).

The table is a bounded LRU, per serving process: at most `max_sessions` bindings, the
least recently used evicted first; a binding unused for `ttl_s` expires. Entries are kept
in order of last use, so the expired ones are always at the old end: a lookup and a bind
drop them from there (amortised O(1), no timer per entry). A binding is keyed by a
16-byte digest of (session, model, leg), whatever the session's length, so the table's
size is fixed per binding: about `ENTRY_BYTES` (measured: tests/unit/placement), ~23 MiB
at the default 100,000.
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType

from gateway.config import AffinityConfig
from gateway.core.roles import Role
from gateway.upstream.worker import Worker

MAX_SESSION_KEY = 256  # characters: longer names no session (the digest bounds the table)
ENTRY_BYTES = 240  # what one binding costs the table at most (digest, value, LRU links)
NO_BINDING: Mapping[Role, str] = MappingProxyType({})

Key = tuple[str, str, Role]  # (session, model, leg)


def digest(key: Key) -> bytes:
    """A binding's key as stored: 16 bytes, whatever the session (a collision needs
    2^64 sessions)."""
    session, model, leg = key
    data = f"{session}\0{model}\0{leg.value}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).digest()


EVICT_AT_ONCE = 64


class AffinityResult(enum.Enum):
    HIT = "hit"  # the bound worker took the leg
    MISS = "miss"  # no binding: placed by the policy, and bound
    REBIND = "rebind"  # the bound worker could not take it: placed afresh, bound again


def affinity_result(bound: str | None, placed: str) -> AffinityResult:
    """What one leg's placement was, given the worker it was bound to."""
    if bound is None:
        return AffinityResult.MISS
    return AffinityResult.HIT if bound == placed else AffinityResult.REBIND


def session_key(value: str | None) -> str | None:
    """The session a header value names: none when absent, empty or too long."""
    if not value or len(value) > MAX_SESSION_KEY:
        return None
    return value


class SessionTable:
    """(session, model, leg) -> worker id, an LRU bounded in size and in idle time."""

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self._entries: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key, now: float) -> str | None:
        """The worker `key` is bound to (its binding used again: young and recent), or
        None."""
        self._expire(now)
        stored = digest(key)
        found = self._entries.get(stored)
        if found is None:
            return None
        self._entries[stored] = (found[0], now)
        self._entries.move_to_end(stored)
        return found[0]

    def bind(self, key: Key, worker: str, now: float) -> None:
        """`key` bound to `worker` as of `now`; the least recently used go past the bound."""
        self._expire(now)
        stored = digest(key)
        self._entries[stored] = (worker, now)
        self._entries.move_to_end(stored)
        # At most EVICT_AT_ONCE a binding: a bound lowered by a reload is reached over
        # the next bindings, never in one burst on the event loop.
        for _ in range(min(len(self._entries) - self.max_sessions, EVICT_AT_ONCE)):
            self._entries.popitem(last=False)

    def _expire(self, now: float) -> None:
        entries, oldest = self._entries, now - self.ttl_s
        while entries:
            key, (_, used) = next(iter(entries.items()))
            if used > oldest:
                return
            del entries[key]


class Affinity:
    """A serving process's session bindings and their outcomes per (model, outcome),
    written by placement only (`Placing`), read by the metrics at scrape time."""

    def __init__(self, settings: AffinityConfig) -> None:
        self.table = SessionTable(settings.max_sessions, settings.ttl_s)
        self.outcomes: dict[tuple[str, AffinityResult], int] = {}
        # Told every binding made (the shared store's follower, gateway.state.sessions).
        self.on_bind: Callable[[Key, str], object] | None = None

    def configure(self, settings: AffinityConfig) -> None:
        """A reload: the bound and the expiry, from the next binding on (a smaller bound
        evicts the least recently used as the next binding is made)."""
        self.table.max_sessions, self.table.ttl_s = settings.max_sessions, settings.ttl_s

    def bound(
        self, session: str, model: str, legs: Collection[Role], now: float
    ) -> Mapping[Role, str]:
        """The workers the session is bound to for the model, by leg (encoders never are:
        their items are spread by content)."""
        table = self.table
        found: dict[Role, str] = {
            leg: worker
            for leg in legs
            if leg is not Role.ENCODE and (worker := table.get((session, model, leg), now))
        }
        return MappingProxyType(found) if found else NO_BINDING

    def placed(
        self,
        session: str,
        model: str,
        workers: Mapping[Role, Worker],
        bound: Mapping[Role, str],
        now: float,
    ) -> None:
        """Each leg placed: the session bound to its worker, the outcome counted."""
        for leg, worker in workers.items():
            key = (model, affinity_result(bound.get(leg), worker.id))
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            self.table.bind((session, model, leg), worker.id, now)
            if self.on_bind is not None:
                self.on_bind((session, model, leg), worker.id)
