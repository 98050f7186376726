"""Which workers hold which request right now, so Abort reaches every leg that has it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.upstream.worker import Worker


@dataclass(eq=False, slots=True)
class InflightCall:
    """One upstream call of a client request: the worker and the id it knows it by
    (`<id>-<i>` for choice i of an n>1 request split up)."""

    worker: Worker
    upstream_id: str
    principal: str | None = None  # who started the request: only they may abort it
    # Decode legs only: set at the leg's first message. An abort waits for it (bounded) so
    # that the KV handoff from prefill to decode is not torn in the middle.
    started: asyncio.Event | None = None
    # Placed by the endpoint picker: Envoy relays it straight to the worker, under the
    # client's own request id (an Abort of it alone can go there too).
    direct: bool = False


@dataclass(frozen=True, slots=True)
class AbortKey:
    """How an upstream call is found by Abort: the client's request id, the id the worker
    knows the call by, and the principal that started it."""

    request_id: str
    upstream_id: str
    principal: str | None = None


class InflightTable:
    def __init__(self) -> None:
        self._holders: dict[str, list[InflightCall]] = {}

    def add(self, request_id: str, holder: InflightCall) -> None:
        if request_id:
            self._holders.setdefault(request_id, []).append(holder)

    def discard(self, request_id: str, holder: InflightCall) -> None:
        holders = self._holders.get(request_id)
        if holders is None:
            return
        if holder in holders:
            holders.remove(holder)
        if not holders:
            del self._holders[request_id]

    def holders(self, request_id: str, principal: str | None = None) -> list[InflightCall]:
        """The calls of a request that `principal` started (an id held for someone else
        looks exactly like an id not held at all)."""
        return [h for h in self._holders.get(request_id, ()) if h.principal == principal]

    def __len__(self) -> int:
        return len(self._holders)
