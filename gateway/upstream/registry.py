"""The registry: which workers serve which model, on which runtime, for which leg: the
clusters (gateway/upstream/cluster.py), made when their first worker arrives and dropped
with their last.

Every change is published as a `FleetEvent` to the listeners (the health service, the
admin watch stream, metrics, logs), so nothing polls the registry for changes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import structlog

from gateway.config import WorkerSpec
from gateway.core.roles import Role, Runtime
from gateway.upstream.cluster import Cluster, ClusterFactory, ClusterKey
from gateway.upstream.worker import Worker, WorkerStatus


@dataclass(frozen=True, slots=True)
class FleetEvent:
    kind: str  # added | removed | status | outlier | capacity (a slot free, a fresh load)
    worker: Worker
    old: str = ""
    new: str = ""
    cause: str = ""


Listener = Callable[[FleetEvent], None]
# The events that change the fleet (what its state, health and log follow); `capacity`
# comes at every request's end and goes only to those who ask for it.
CHANGES = frozenset({"added", "removed", "status", "outlier"})
EVERY = CHANGES | {"capacity"}


@dataclass(slots=True)
class Unidentified:
    """A worker the configuration or a discovery source names that has not yet said what
    it serves (down at start, or still being asked): not routable, but its model (when
    its URL names one) is declared, and its leg may be the one a call needs."""

    spec: WorkerSpec
    sources: tuple[str, ...]
    since: float  # monotonic
    error: str = ""  # why the last question failed, if it did

    def could_be(self, model: str, runtime: Runtime | None, role: Role | None) -> bool:
        """Whether it may turn out to serve `model` (on `runtime`, for leg `role`: None,
        any): what its URL leaves open may be anything."""
        spec = self.spec
        return (
            spec.model in (None, model)
            and (runtime is None or spec.runtime in (None, runtime))
            and (role is None or spec.role in (None, role))
        )


log = structlog.get_logger("gateway.upstream")


class Registry:
    """Model -> runtime -> role -> cluster. `clusters` makes a cluster for a key that has
    none yet (its policy and limits)."""

    def __init__(self, clusters: ClusterFactory) -> None:
        self._clusters = clusters
        self._by_id: dict[str, Worker] = {}
        self._index: dict[str, dict[Runtime, dict[Role, Cluster]]] = {}
        # Replaced, never changed in place: a publish reads the tuple it started with.
        self._listeners: tuple[tuple[Listener, frozenset[str]], ...] = ()
        self._capacity_heard = False  # a listener follows `capacity` (else none is made)
        self._unidentified: dict[str, Unidentified] = {}

    def subscribe(self, listener: Listener, kinds: frozenset[str] = CHANGES) -> None:
        """`listener(event)` for every event of `kinds` from now on."""
        self._listeners = (*self._listeners, (listener, kinds))
        self._capacity_heard = any("capacity" in k for _, k in self._listeners)

    def unsubscribe(self, listener: Listener) -> None:
        self._listeners = tuple((known, k) for known, k in self._listeners if known != listener)
        self._capacity_heard = any("capacity" in k for _, k in self._listeners)

    def add(self, worker: Worker) -> None:
        self._by_id[worker.id] = worker
        roles = self._index.setdefault(worker.model, {}).setdefault(worker.runtime, {})
        cluster = roles.get(worker.role)
        if cluster is None:
            key = ClusterKey(worker.model, worker.runtime, worker.role)
            cluster = roles[worker.role] = self._clusters(key)
        cluster.admit(worker)
        worker.told(self._status_changed)
        self.publish(FleetEvent("added", worker, new=worker.status.value))

    def identifying(self, spec: WorkerSpec, sources: tuple[str, ...], now: float) -> None:
        """A named worker is being asked what it serves (the fleet's join)."""
        self._unidentified[spec.address] = Unidentified(spec, sources, now)

    def unanswered(self, address: str, error: str) -> None:
        """Why asking a worker that is being identified failed, this time."""
        entry = self._unidentified.get(address)
        if entry is not None:
            entry.error = error

    def identified(self, address: str) -> None:
        """Its join ended: registered (`add`), or given up (removed before it answered)."""
        self._unidentified.pop(address, None)

    def being_identified(self, address: str) -> bool:
        return address in self._unidentified

    @property
    def identifying_count(self) -> int:
        return len(self._unidentified)

    def unidentified(self) -> list[Unidentified]:
        """The workers being identified, by address."""
        return [self._unidentified[a] for a in sorted(self._unidentified)]

    def awaits(self, model: str, runtime: Runtime | None = None, role: Role | None = None) -> int:
        """How many workers being identified may serve `model` (on `runtime`, leg `role`):
        while any may, a missing model or leg is not yet known to be missing."""
        return sum(1 for u in self._unidentified.values() if u.could_be(model, runtime, role))

    def remove(self, worker: Worker) -> None:
        if self._by_id.get(worker.id) is not worker:
            return
        del self._by_id[worker.id]
        worker.told(None)
        runtimes = self._index[worker.model]
        roles = runtimes[worker.runtime]
        roles[worker.role].evict(worker)
        if not roles[worker.role].workers:
            del roles[worker.role]
        if not roles:
            del runtimes[worker.runtime]
        if not runtimes:
            del self._index[worker.model]
        self.publish(FleetEvent("removed", worker, old=worker.status.value))

    def _status_changed(self, worker: Worker, old: WorkerStatus, cause: str) -> None:
        """A worker's signals changed its status (it tells, as it holds them)."""
        self.publish(FleetEvent("status", worker, old.value, worker.status.value, cause))

    def capacity(self, worker: Worker) -> None:
        """A slot on `worker` came free, or its load was reported again: whoever waits
        for room hears it (a `capacity` event; none is made when no one listens)."""
        if self._capacity_heard:
            self.publish(FleetEvent("capacity", worker))

    def publish(self, event: FleetEvent) -> None:
        """Tell every listener; one that raises is logged and skipped, so it can neither
        keep the others from hearing nor fail whatever changed the fleet (a request)."""
        kind = event.kind
        for listener, kinds in self._listeners:
            if kind not in kinds:
                continue
            try:
                listener(event)
            except Exception:
                log.exception(
                    "fleet_listener_failed",
                    listener=getattr(listener, "__qualname__", repr(listener)),
                    kind=event.kind,
                    worker=event.worker.id,
                )

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

    def serves(self, model: str, runtime: Runtime) -> bool:
        """Whether `model` is served over `runtime`'s protocol (on every call's path: a
        lookup, not a sorted list of every model)."""
        return runtime in self._index.get(model, {})

    def runtimes(self, model: str) -> list[Runtime]:
        return sorted(self._index.get(model, {}))

    def cluster(self, model: str, runtime: Runtime, role: Role) -> Cluster | None:
        return self._index.get(model, {}).get(runtime, {}).get(role)

    def pool(self, model: str, runtime: Runtime, role: Role) -> Sequence[Worker]:
        cluster = self.cluster(model, runtime, role)
        return () if cluster is None else cluster.workers

    def has_role(self, model: str, role: Role) -> bool:
        """Whether any runtime has workers of this leg for the model (no list built)."""
        return any(role in roles for roles in self._index.get(model, {}).values())

    def every_cluster(self) -> list[Cluster]:
        """Every cluster of every model (a reload brings each to its settings now)."""
        runtimes = [roles for by_runtime in self._index.values() for roles in by_runtime.values()]
        return [cluster for roles in runtimes for cluster in roles.values()]

    def clusters(self, model: str, role: Role) -> list[Cluster]:
        """A leg's clusters on every runtime, in runtime order."""
        runtimes = self._index.get(model, {})
        return [runtimes[rt][role] for rt in sorted(runtimes) if role in runtimes[rt]]

    def role_pool(self, model: str, role: Role) -> list[Worker]:
        """A leg's workers on every runtime (is the leg deployed at all?)."""
        return [w for cluster in self.clusters(model, role) for w in cluster.workers]

    def workers_of(
        self, model: str, runtime: Runtime | None = None, roles: Collection[Role] = tuple(Role)
    ) -> list[Worker]:
        runtimes = self._index.get(model, {})
        return [
            w
            for rt in sorted(runtimes)
            if runtime is None or rt is runtime
            for role in sorted(runtimes[rt])
            if role in roles
            for w in runtimes[rt][role].workers
        ]


__all__ = ["CHANGES", "EVERY", "FleetEvent", "Listener", "Registry", "Unidentified", "WorkerStatus"]
