"""The gateway's own grpc.health.v1 service, driven by fleet events.

Written for this rather than the stock aio servicer, which has no List and loses Watch
updates when one of several watchers leaves. Names served:
  "" and "liveness"        SERVING while the process runs and is not draining
  "readiness"              SERVING iff at least one model is servable
  <engine service name>    SERVING iff a model served over that protocol is servable
  "models/<model-id>"      SERVING iff that model is servable
Check answers from memory; Watch streams every change to every watcher; List returns all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.engines import ADAPTERS
from gateway.roles import Runtime

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

LIVENESS = ("", "liveness")
_CLOSED = -1  # not a ServingStatus: tells a Watch stream to end
READINESS = "readiness"


def model_entry(model: str) -> str:
    return f"models/{model}"


def desired_statuses(
    draining: bool,
    models_by_runtime: dict[Runtime, list[str]],
    servable: Callable[[str, Runtime], bool],
) -> dict[str, int]:
    """Every health entry's status from the fleet's state (pure)."""
    statuses: dict[str, int] = {}
    serving_models: set[str] = set()
    for runtime, models in models_by_runtime.items():
        up = [m for m in models if servable(m, runtime)]
        serving_models.update(up)
        statuses[ADAPTERS[runtime].service_name] = SERVING if up else NOT_SERVING
    for models in models_by_runtime.values():
        for model in models:
            statuses[model_entry(model)] = SERVING if model in serving_models else NOT_SERVING
    statuses[READINESS] = SERVING if serving_models else NOT_SERVING
    for name in LIVENESS:
        statuses[name] = SERVING
    if draining:
        statuses = dict.fromkeys(statuses, NOT_SERVING)
    return statuses


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self._statuses: dict[str, int] = {}
        self._watchers: dict[str, set[asyncio.Queue[int]]] = {}
        self._closed = False

    def status(self, name: str) -> int | None:
        return self._statuses.get(name)

    def update(self, statuses: dict[str, int]) -> None:
        """Replace every entry; entries that disappear (a removed model) go NOT_SERVING."""
        for name in set(self._statuses) - set(statuses):
            statuses[name] = NOT_SERVING
        for name, status in statuses.items():
            if self._statuses.get(name) != status:
                self._statuses[name] = status
                for queue in self._watchers.get(name, ()):
                    queue.put_nowait(status)

    def close_watches(self) -> None:
        """End every Watch stream (after the NOT_SERVING it has already been sent).

        A server stopping with a grace period waits for its open calls, and a Watch only
        ends when its client leaves: without this, every client that health-checks over
        Watch would hold the shutdown for the whole grace."""
        self._closed = True
        for queues in self._watchers.values():
            for queue in queues:
                queue.put_nowait(_CLOSED)

    def names(self) -> Iterable[str]:
        return list(self._statuses)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
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
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        name = request.service
        queue: asyncio.Queue[int] = asyncio.Queue()
        watchers = self._watchers.setdefault(name, set())
        watchers.add(queue)
        try:
            last = self._statuses.get(name, SERVICE_UNKNOWN)
            yield health_pb2.HealthCheckResponse(status=last)
            while not self._closed:
                status = await queue.get()
                if status == _CLOSED:
                    return
                if status != last:
                    last = status
                    yield health_pb2.HealthCheckResponse(status=status)
        finally:
            watchers.discard(queue)
            if not watchers:
                self._watchers.pop(name, None)
