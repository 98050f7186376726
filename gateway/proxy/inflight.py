"""Which workers hold which request id right now, so Abort reaches the right ones."""

from __future__ import annotations

from gateway.fleet.worker import Worker


class InflightTable:
    def __init__(self) -> None:
        self._holders: dict[str, list[Worker]] = {}

    def add(self, request_id: str, worker: Worker) -> None:
        if request_id:
            self._holders.setdefault(request_id, []).append(worker)

    def discard(self, request_id: str, worker: Worker) -> None:
        holders = self._holders.get(request_id)
        if holders is None:
            return
        if worker in holders:
            holders.remove(worker)
        if not holders:
            del self._holders[request_id]

    def holders(self, request_id: str) -> list[Worker]:
        return list(self._holders.get(request_id, ()))

    def __len__(self) -> int:
        return len(self._holders)
