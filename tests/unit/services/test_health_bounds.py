"""Health Watch bounds (gateway.services.health): distinct names per client connection, unknown
names answered without state keyed by them, and Check of unknown names keeping nothing.

Pure tests with a fake servicer context (no network)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.services.health import (
    MAX_NAMES_PER_PEER,
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVING,
    HealthService,
)

PER_PEER = (
    f"too many services watched on this connection: at most {MAX_NAMES_PER_PEER} "
    "distinct names at once"
)
Watch = AsyncGenerator[health_pb2.HealthCheckResponse, None]


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    """What HealthService asks of an aio.ServicerContext."""

    def __init__(self, peer: str = "ipv4:10.0.0.1:5555") -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def request(name: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=name)


def served(max_watches: int = 1024) -> HealthService:
    service = HealthService(max_watches)
    service.update({"": SERVING, "liveness": SERVING, "readiness": SERVING, "models/m": SERVING})
    return service


async def refused(awaitable: Any) -> Aborted:
    with pytest.raises(Aborted) as caught:
        await awaitable
    return caught.value


def sizes(service: HealthService) -> dict[str, int]:
    """The size of every container the service holds: whatever it keys by name, by
    connection or by watcher shows here."""
    return {
        name: len(value)
        for name, value in vars(service).items()
        if isinstance(value, dict | set | list | tuple)
    }


async def opened(service: HealthService, name: str, peer: str = "ipv4:10.0.0.1:5555") -> Watch:
    """A Watch stream whose first answer has been read (so it is registered)."""
    watch = service.Watch(request(name), Context(peer))
    await anext(watch)
    return watch


async def test_one_connection_watches_at_most_16_distinct_names() -> None:
    service = served()
    # Served and unknown names count alike.
    names = ["", "liveness", "readiness", "models/m"] + [f"models/x{i}" for i in range(12)]
    assert len(names) == MAX_NAMES_PER_PEER == 16
    watches = [await opened(service, name) for name in names]
    error = await refused(anext(service.Watch(request("models/one-more"), Context())))
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details == PER_PEER
    assert service.watching == 16  # the refused one left nothing behind
    # A name this connection watches already is no new name: a second watch of it is fine.
    again = await opened(service, "models/m")
    # Another connection has its own 16.
    other = await opened(service, "models/one-more", peer="ipv4:10.0.0.1:6666")
    # One of the 16 ends: a new name fits again.
    await watches.pop().aclose()
    newcomer = await opened(service, "models/one-more")
    for watch in [*watches, again, other, newcomer]:
        await watch.aclose()
    assert service.watching == 0
    assert service._peers == {} and service._watchers == {} and service._unknown == set()


async def test_the_total_cap_still_comes_first() -> None:
    service = served(max_watches=2)
    watches = [await opened(service, "", peer=f"ipv4:10.0.0.{i}:1") for i in range(2)]
    error = await refused(anext(service.Watch(request("models/m"), Context("ipv4:10.0.0.9:1"))))
    assert (error.code, error.details) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "too many health watches",
    )
    for watch in watches:
        await watch.aclose()


async def test_an_unknown_name_gets_service_unknown_once_then_its_status() -> None:
    service = served()
    watch = service.Watch(request("models/later"), Context())
    assert (await anext(watch)).status == SERVICE_UNKNOWN
    assert "models/later" not in service._watchers  # held apart, not keyed by its name
    assert len(service._unknown) == 1
    # Updates that do not name it send nothing.
    service.update({"": SERVING, "models/m": NOT_SERVING})
    (watcher,) = service._unknown
    assert not watcher.pending
    # It appears: the watcher moves to the name's own set and hears its status.
    service.update({"": SERVING, "models/m": SERVING, "models/later": SERVING})
    assert service._unknown == set() and len(service._watchers["models/later"]) == 1
    assert (await anext(watch)).status == SERVING
    service.update({"": SERVING, "models/m": SERVING, "models/later": NOT_SERVING})
    assert (await anext(watch)).status == NOT_SERVING
    await watch.aclose()
    assert service._watchers == {} and service._peers == {}


async def test_close_watches_ends_the_watches_of_unknown_names_too() -> None:
    service = served()
    watch = service.Watch(request("models/never"), Context())
    assert (await anext(watch)).status == SERVICE_UNKNOWN
    service.close_watches()
    assert [r.status async for r in watch] == []
    assert service.watching == 0 and service._unknown == set()


async def test_ten_thousand_unknown_names_leave_no_state_behind() -> None:
    service = served()
    before = sizes(service)
    # One after the other, on one connection and on many.
    for i in range(10_000):
        watch = await opened(service, f"models/nope-{i}", peer=f"ipv4:10.1.{i % 200}.1:1")
        await watch.aclose()
    assert sizes(service) == before
    # At once: bounded by the per-connection and total caps, whatever the names.
    watches = []
    for i in range(64):
        peer = f"ipv4:10.2.0.{i % 4}:1"
        name = f"models/at-once-{i}"
        if i // 4 < MAX_NAMES_PER_PEER:
            watches.append(await opened(service, name, peer))
        else:
            error = await refused(anext(service.Watch(request(name), Context(peer))))
            assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    during = sizes(service)
    assert during["_unknown"] == len(watches) == 64
    assert during["_watchers"] == before["_watchers"]  # nothing keyed by an unknown name
    assert during["_statuses"] == before["_statuses"]
    assert during["_peers"] == 4
    for watch in watches:
        await watch.aclose()
    assert sizes(service) == before


async def test_ten_thousand_checks_of_unknown_names_keep_nothing() -> None:
    service = served()
    before = sizes(service)
    for i in range(10_000):
        error = await refused(service.Check(request(f"models/nope-{i}"), Context()))
        assert error.code is grpc.StatusCode.NOT_FOUND
        assert error.details == f"unknown service 'models/nope-{i}'"
    assert sizes(service) == before


async def test_known_names_still_share_one_entry_per_name() -> None:
    service = served()
    watches = [await opened(service, "models/m", peer=f"ipv4:10.3.0.{i}:1") for i in range(3)]
    assert list(service._watchers) == ["models/m"] and len(service._watchers["models/m"]) == 3
    service.update({"": SERVING, "models/m": NOT_SERVING})
    for watch in watches:
        assert (await anext(watch)).status == NOT_SERVING
        await watch.aclose()
    assert service._watchers == {} and service._peers == {}
