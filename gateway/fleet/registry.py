"""The registry: which workers serve which model, on which runtime, for which leg."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from gateway.fleet.worker import Worker, WorkerStatus
from gateway.roles import Role, Runtime

Listener = Callable[[Worker], None]


class Registry:
    """Model -> runtime -> role -> workers, kept sorted by worker id for stable policies."""

    def __init__(self) -> None:
        self._by_id: dict[str, Worker] = {}
        self._index: dict[str, dict[Runtime, dict[Role, list[Worker]]]] = {}
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        """Called with the worker after every registration, removal or status change."""
        self._listeners.append(listener)

    def add(self, worker: Worker) -> None:
        self._by_id[worker.id] = worker
        pool = self._index.setdefault(worker.model, {}).setdefault(worker.runtime, {})
        workers = pool.setdefault(worker.role, [])
        workers.append(worker)
        workers.sort(key=lambda w: w.id)
        self._notify(worker)

    def remove(self, worker: Worker) -> None:
        self._by_id.pop(worker.id, None)
        runtimes = self._index.get(worker.model, {})
        roles = runtimes.get(worker.runtime, {})
        if worker in roles.get(worker.role, []):
            roles[worker.role].remove(worker)
            if not roles[worker.role]:
                del roles[worker.role]
            if not roles:
                del runtimes[worker.runtime]
            if not runtimes:
                del self._index[worker.model]
        self._notify(worker)

    def set_status(self, worker: Worker, status: WorkerStatus, cause: str) -> bool:
        """Record a status change; returns whether anything changed."""
        if worker.status is status:
            return False
        worker.status, worker.status_cause = status, cause
        self._notify(worker)
        return True

    def get(self, worker_id: str) -> Worker | None:
        return self._by_id.get(worker_id)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def models(self, runtime: Runtime | None = None) -> list[str]:
        """Models served, optionally only those served over one runtime's protocol."""
        return sorted(
            model
            for model, runtimes in self._index.items()
            if runtime is None or runtime in runtimes
        )

    def runtimes(self, model: str) -> list[Runtime]:
        return sorted(self._index.get(model, {}))

    def pool(self, model: str, runtime: Runtime, role: Role) -> Sequence[Worker]:
        return self._index.get(model, {}).get(runtime, {}).get(role, ())

    def workers_of(self, model: str, runtime: Runtime) -> list[Worker]:
        roles = self._index.get(model, {}).get(runtime, {})
        return [w for role in sorted(roles) for w in roles[role]]

    def _notify(self, worker: Worker) -> None:
        for listener in self._listeners:
            listener(worker)
