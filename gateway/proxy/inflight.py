"""Which workers hold which request right now, so Abort reaches every leg that has it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.fleet.worker import Worker


@dataclass(eq=False, slots=True)
class Holder:
    """One upstream call of a client request: the worker and the id it knows it by
    (`<id>-<i>` for choice i of an n>1 request split up)."""

    worker: Worker
    upstream_id: str
    # Decode legs only: set at the leg's first message. An abort waits for it (bounded) so
    # that the KV handoff from prefill to decode is not torn in the middle.
    started: asyncio.Event | None = None


class InflightTable:
    def __init__(self) -> None:
        self._holders: dict[str, list[Holder]] = {}

    def add(self, request_id: str, holder: Holder) -> None:
        if request_id:
            self._holders.setdefault(request_id, []).append(holder)

    def discard(self, request_id: str, holder: Holder) -> None:
        holders = self._holders.get(request_id)
        if holders is None:
            return
        if holder in holders:
            holders.remove(holder)
        if not holders:
            del self._holders[request_id]

    def holders(self, request_id: str) -> list[Holder]:
        return list(self._holders.get(request_id, ()))

    def __len__(self) -> int:
        return len(self._holders)
