"""The health service's Watch bounds over a real connection: a connection's 17th distinct
name is refused with RESOURCE_EXHAUSTED and its message while another connection still
watches; an unknown name is answered SERVICE_UNKNOWN once, the stream stays open, and the
name's status follows if it appears. Server and clients in the test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.services.health import MAX_NAMES_PER_PEER, SERVICE_UNKNOWN, SERVING, HealthService
from tests.support.waits import until

STATUSES = {"": SERVING, "liveness": SERVING, "readiness": SERVING, "models/m": SERVING}


@pytest.fixture
async def health() -> AsyncIterator[tuple[HealthService, str]]:
    service = HealthService()
    service.update(dict(STATUSES))
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield service, f"127.0.0.1:{port}"
    finally:
        service.close_watches()
        await server.stop(None)


def connection(address: str) -> aio.Channel:
    """A channel with a connection of its own (grpc shares one between channels to one
    address otherwise)."""
    return aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def watch(channel: aio.Channel, name: str) -> Any:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=name))


async def first(call: Any) -> int:
    async with asyncio.timeout(5):
        reply = await call.read()
    return int(reply.status)


async def test_a_connections_17th_name_is_refused_and_another_connection_is_not(
    health: tuple[HealthService, str],
) -> None:
    service, address = health
    async with connection(address) as one, connection(address) as two:
        names = ["", "liveness", "readiness", "models/m"]
        names += [f"models/unknown-{i}" for i in range(MAX_NAMES_PER_PEER - len(names))]
        calls = [watch(one, name) for name in names]
        seen = [await first(call) for call in calls]
        assert seen == [SERVING] * 4 + [SERVICE_UNKNOWN] * (MAX_NAMES_PER_PEER - 4)
        refused = watch(one, "models/one-too-many")
        with pytest.raises(aio.AioRpcError) as caught:
            await first(refused)
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert caught.value.details() == (
            "too many services watched on this connection: at most 16 distinct names at once"
        )
        other = watch(two, "models/one-too-many")
        assert await first(other) == SERVICE_UNKNOWN
        assert len(service._peers) == 2 and service.watching == MAX_NAMES_PER_PEER + 1
        for call in [*calls, other]:
            call.cancel()
    await until(lambda: service.watching == 0, within_s=5)
    assert service._peers == {} and service._unknown == set() and service._watchers == {}


async def test_an_unknown_name_is_answered_once_and_followed_once_it_appears(
    health: tuple[HealthService, str],
) -> None:
    service, address = health
    async with connection(address) as channel:
        call = watch(channel, "models/late")
        assert await first(call) == SERVICE_UNKNOWN
        # Nothing more while the name stays unknown, whatever else changes.
        service.update({**STATUSES, "models/m": SERVING})
        read = asyncio.ensure_future(call.read())
        done, _ = await asyncio.wait({read}, timeout=0.2)
        assert not done  # the stream is open and silent
        service.update({**STATUSES, "models/late": SERVING})
        async with asyncio.timeout(5):
            reply = await read
        assert reply.status == SERVING
        call.cancel()
