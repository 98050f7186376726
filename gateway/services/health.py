"""The gateway's own grpc.health.v1 service, driven by fleet events.

Written for this rather than the stock aio servicer, which has no List and loses Watch
updates when one of several watchers leaves. Names served:
  "" and "liveness"        SERVING while the process runs and is not draining
  "readiness"              SERVING iff at least one model is servable
  <engine service name>    SERVING iff a model served over that protocol is servable
  "models/<model-id>"      SERVING iff that model is servable (an alias: one of its targets)
  "envoy.service.ext_proc.v3.ExternalProcessor"
                           with the endpoint picker on: as "" (it answers every call)
Check answers from memory; Watch streams every change to every watcher; List returns all.

With API keys (`guard`), Check and Watch on any name but the probes' ("", liveness,
readiness: a load balancer's or kubelet's probe carries no key) need a key, as List does
(that one at the interceptor): the other names tell which models are served. Watch
streams are bounded (`max_watches` in all, `max_names_per_peer` distinct names per client
connection, and names no longer than the longest entry), and a watcher that does not read
holds at most a few pending statuses.

No name a client sends becomes a key of long-lived state: entries are the fleet's names
only. A Check of an unknown name is NOT_FOUND (the health protocol's answer for Check); a
Watch of one is sent SERVICE_UNKNOWN once and stays open (the protocol's answer for
Watch: the name may appear), held in one set of such watchers (not keyed by name) until
its name appears or it ends. The per-connection count of watched names lives only as long
as that connection's watches do.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Iterable, Mapping

import grpc
import structlog
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import MAX_NAME
from gateway.core.health import CHECK, WATCH
from gateway.core.roles import Runtime
from gateway.engines import Adapters

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

log = structlog.get_logger("gateway.services.health")

LIVENESS = ("", "liveness")
_CLOSED = -1  # not a ServingStatus: tells a Watch stream to end
READINESS = "readiness"
PROBE_NAMES = frozenset({*LIVENESS, READINESS})  # open to callers without an API key
MAX_WATCHES = 1024
MAX_NAMES_PER_PEER = 16  # distinct names one client connection may watch at once
MAX_SHOWN = 256  # characters of an unknown name that NOT_FOUND repeats
WATCH_BACKLOG = 4  # statuses kept for a watcher that does not read: the newest ones
# Asked before a Check or Watch of a name that is not a probe's: returns, or aborts the
# call (UNAUTHENTICATED). `ApiKeyAuth.require(context, method)`.
Guard = Callable[[aio.ServicerContext, str], Awaitable[None]]


def model_entry(model: str) -> str:
    return f"models/{model}"


MAX_SERVICE_NAME = len(model_entry("m" * MAX_NAME))  # the longest name an entry can have


def shown(name: str) -> str:
    return name if len(name) <= MAX_SHOWN else name[:MAX_SHOWN] + "..."


def desired_statuses(
    draining: bool,
    models_by_runtime: dict[Runtime, list[str]],
    servable: Callable[[str, Runtime], bool],
    adapters: Adapters,
    aliases: Mapping[str, Collection[str]] | None = None,
    live: Collection[str] = (),
    declared: Collection[str] = (),
) -> dict[str, int]:
    """Every health entry's status from the fleet's state (pure); `adapters` name each
    protocol's entry (its engine service); `aliases`: each model alias and the models it
    may send to (SERVING iff one of them is); `live`: more names SERVING as liveness is
    (the endpoint picker's service: it answers every call, a verdict if need be);
    `declared`: the models the configuration names, NOT_SERVING while no worker serves
    them (down or not yet identified: known, not unknown)."""
    statuses: dict[str, int] = {}
    serving_models: set[str] = set()
    for runtime, models in models_by_runtime.items():
        up = [m for m in models if servable(m, runtime)]
        serving_models.update(up)
        statuses[adapters[runtime].service_name] = SERVING if up else NOT_SERVING
    for models in models_by_runtime.values():
        for model in models:
            statuses[model_entry(model)] = SERVING if model in serving_models else NOT_SERVING
    for model in declared:
        statuses.setdefault(model_entry(model), NOT_SERVING)
    for alias, targets in (aliases or {}).items():
        routed = any(target in serving_models for target in targets)
        statuses[model_entry(alias)] = SERVING if routed else NOT_SERVING
    statuses[READINESS] = SERVING if serving_models else NOT_SERVING
    for name in (*LIVENESS, *live):
        statuses[name] = SERVING
    if draining:
        statuses = dict.fromkeys(statuses, NOT_SERVING)
    return statuses


class _Watcher:
    """One Watch stream: its name and pending statuses, the newest WATCH_BACKLOG (a
    watcher that reads sees every change; one that stalls holds a few ints, not every
    change)."""

    __slots__ = ("name", "pending", "wake")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: deque[int] = deque(maxlen=WATCH_BACKLOG)
        self.wake = asyncio.Event()

    def push(self, status: int) -> None:
        self.pending.append(status)
        self.wake.set()


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """`max_watches`: Watch streams at once; `max_names_per_peer`: distinct names one
    client connection watches at once (over either: RESOURCE_EXHAUSTED); `guard`: asked
    before a Check or Watch of a name other than the probes' (API keys on)."""

    def __init__(
        self,
        max_watches: int = MAX_WATCHES,
        guard: Guard | None = None,
        *,
        max_names_per_peer: int = MAX_NAMES_PER_PEER,
    ) -> None:
        self._statuses: dict[str, int] = {}  # the fleet's names only, never a client's
        self._watchers: dict[str, set[_Watcher]] = {}  # keys: names in _statuses only
        self._unknown: set[_Watcher] = set()  # watchers of names not (yet) served
        # Client connection -> the names its open watches follow, with how many watch each:
        # an entry lives only as long as the watch that made it.
        self._peers: dict[str, dict[str, int]] = {}
        self._closed = False
        self._max_watches = max_watches
        self._max_names_per_peer = max_names_per_peer
        self._watching = 0
        self._full = False  # the cap was hit and logged; logged again once below it
        self._guard = guard

    @property
    def watching(self) -> int:
        return self._watching

    def status(self, name: str) -> int | None:
        return self._statuses.get(name)

    def update(self, statuses: dict[str, int]) -> None:
        """Replace every entry; entries that disappear (a removed model) go NOT_SERVING.
        Watchers of a name that appears move from the unknown set to that name's own."""
        for name in set(self._statuses) - set(statuses):
            statuses[name] = NOT_SERVING
        appeared = statuses.keys() - self._statuses.keys()
        if appeared and self._unknown:
            for watcher in [w for w in self._unknown if w.name in appeared]:
                self._unknown.discard(watcher)
                self._watchers.setdefault(watcher.name, set()).add(watcher)
        for name, status in statuses.items():
            if self._statuses.get(name) != status:
                self._statuses[name] = status
                for watcher in self._watchers.get(name, ()):
                    watcher.push(status)

    def close_watches(self) -> None:
        """End every Watch stream (after the NOT_SERVING it has already been sent).

        A server stopping with a grace period waits for its open calls, and a Watch only
        ends when its client leaves: without this, every client that health-checks over
        Watch would hold the shutdown for the whole grace."""
        self._closed = True
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.push(_CLOSED)
        for watcher in self._unknown:
            watcher.push(_CLOSED)

    def names(self) -> Iterable[str]:
        return list(self._statuses)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        name = request.service
        if self._guard is not None and name not in PROBE_NAMES:
            await self._guard(context, CHECK)
        status = self._statuses.get(name)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {shown(name)!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(
        self, request: health_pb2.HealthListRequest, context: aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in sorted(self._statuses.items())
            }
        )

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext
    ) -> AsyncGenerator[health_pb2.HealthCheckResponse, None]:
        name = request.service
        if len(name) > MAX_SERVICE_NAME:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"service name longer than {MAX_SERVICE_NAME} characters",
            )
        if self._guard is not None and name not in PROBE_NAMES:
            await self._guard(context, WATCH)
        if self._watching >= self._max_watches:
            if not self._full:
                self._full = True
                log.warning("health watches at their cap: refusing more", max=self._max_watches)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many health watches")
        peer = str(context.peer() or "")
        names = self._peers.get(peer)
        if names is not None and name not in names and len(names) >= self._max_names_per_peer:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many services watched on this connection: at most "
                f"{self._max_names_per_peer} distinct names at once",
            )
        # Registered with no await since the checks: the caps hold however many arrive.
        self._watching += 1
        names = self._peers.setdefault(peer, {})
        names[name] = names.get(name, 0) + 1
        watcher = _Watcher(name)
        last = self._statuses.get(name)
        if last is None:
            self._unknown.add(watcher)  # no state keyed by a name nobody serves
            last = SERVICE_UNKNOWN
        else:
            self._watchers.setdefault(name, set()).add(watcher)
        try:
            yield health_pb2.HealthCheckResponse(status=last)
            while not self._closed or watcher.pending:
                watcher.wake.clear()
                while watcher.pending:
                    status = watcher.pending.popleft()
                    if status == _CLOSED:
                        return
                    if status != last:
                        last = status
                        yield health_pb2.HealthCheckResponse(status=status)
                if self._closed:
                    return
                await watcher.wake.wait()
        finally:
            self._forget(watcher, peer)

    def _forget(self, watcher: _Watcher, peer: str) -> None:
        """A Watch ended: every trace of it goes (the name's entry if it was the last)."""
        self._watching -= 1
        if self._full and self._watching < self._max_watches // 2:
            self._full = False
        name = watcher.name
        self._unknown.discard(watcher)
        watchers = self._watchers.get(name)
        if watchers is not None:
            watchers.discard(watcher)
            if not watchers:
                del self._watchers[name]
        names = self._peers[peer]
        names[name] -= 1
        if not names[name]:
            del names[name]
            if not names:
                del self._peers[peer]
