"""The handler shapes the auth interceptor hands grpc (gateway.security.auth), with one
in-process grpc server: every shape served with a key and refused unread without one, every
shape still served while another address is blocked, and the health list needing a key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.security.auth import MISSING_KEY, REJECTED_KEY, THROTTLED, ApiKeyAuth
from gateway.services.health import SERVING
from tests.support import api_keys
from tests.support.api_keys import ALICE, auth_of, check, health

keys_path = api_keys.keys_path  # the fixture (tests/support/api_keys.py)


# -- the handlers grpc gets, in process ------------------------------------------------


class Echo:
    """Methods of every shape, counting the request messages they read."""

    def __init__(self) -> None:
        self.reads = 0

    async def unary(self, request: bytes, context: aio.ServicerContext) -> bytes:
        self.reads += 1
        return request

    async def server_stream(self, request: bytes, context: aio.ServicerContext) -> Any:
        self.reads += 1
        for _ in range(2):
            yield request

    async def writer(self, request: bytes, context: aio.ServicerContext) -> None:
        self.reads += 1
        await context.write(request)

    async def client_stream(self, requests: Any, context: aio.ServicerContext) -> bytes:
        parts = []
        async for part in requests:
            self.reads += 1
            parts.append(part)
        return b"".join(parts)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "t.Echo",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
                "Writer": grpc.unary_stream_rpc_method_handler(self.writer),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
            },
        )


@pytest.fixture
async def served(keys_path: Path) -> AsyncIterator[tuple[aio.Channel, ApiKeyAuth, Echo]]:
    auth, _, _ = auth_of(keys_path, limit=2)
    auth.clock = asyncio.get_running_loop().time
    echo = Echo()
    server = aio.server(interceptors=[auth.interceptor()])
    server.add_generic_rpc_handlers((echo.handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(health()[0], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch, auth, echo
    await server.stop(None)


async def call_every_shape(ch: aio.Channel, key: str | None) -> list[Any]:
    md = (("authorization", f"Bearer {key}"),) if key else ()
    results: list[Any] = []
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: ch.unary_unary("/t.Echo/Unary")(b"u", metadata=md),
        lambda: _all(ch.unary_stream("/t.Echo/ServerStream")(b"s", metadata=md)),
        lambda: _all(ch.unary_stream("/t.Echo/Writer")(b"w", metadata=md)),
        lambda: ch.stream_unary("/t.Echo/ClientStream")(iter([b"a", b"b"]), metadata=md),
    ]
    for call in calls:
        try:
            results.append(await call())
        except aio.AioRpcError as error:
            results.append((error.code(), error.details()))
    return results


async def _all(call: Any) -> list[bytes]:
    return [message async for message in call]


async def test_every_shape_is_served_with_a_key_and_refused_unread_without(
    served: tuple[aio.Channel, ApiKeyAuth, Echo],
) -> None:
    ch, auth, echo = served
    assert await call_every_shape(ch, ALICE) == [b"u", [b"s", b"s"], [b"w"], b"ab"]
    assert echo.reads == 5
    unauthenticated = (grpc.StatusCode.UNAUTHENTICATED, REJECTED_KEY)
    assert (
        await call_every_shape(ch, "wrong")
        == [unauthenticated] + [(grpc.StatusCode.UNAUTHENTICATED, THROTTLED)] * 3
    )
    assert echo.reads == 5  # nothing refused was read
    # Blocked: the right key is refused too, checked in the handler before any read.
    assert await call_every_shape(ch, ALICE) == [(grpc.StatusCode.UNAUTHENTICATED, THROTTLED)] * 4
    assert echo.reads == 5 and auth.failures.active(auth.clock())


async def test_while_another_address_is_blocked_every_shape_still_serves(
    served: tuple[aio.Channel, ApiKeyAuth, Echo],
) -> None:
    ch, auth, echo = served
    now = auth.clock()
    auth.failures.fail("10.9.9.9", now)
    assert auth.failures.fail("10.9.9.9", now) is True  # checks move into the handlers
    assert await call_every_shape(ch, ALICE) == [b"u", [b"s", b"s"], [b"w"], b"ab"]
    assert echo.reads == 5
    assert (
        await call_every_shape(ch, None)
        == [(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)]
        + [(grpc.StatusCode.UNAUTHENTICATED, THROTTLED)] * 3
    )
    assert echo.reads == 5
    stub = health_pb2_grpc.HealthStub(ch)
    with pytest.raises(aio.AioRpcError) as caught:
        await stub.List(health_pb2.HealthListRequest())
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.UNAUTHENTICATED,
        THROTTLED,
    )
    assert (await stub.Check(check(""))).status == SERVING  # open, even blocked


async def test_health_list_needs_a_key(served: tuple[aio.Channel, ApiKeyAuth, Echo]) -> None:
    ch, _, _ = served
    stub = health_pb2_grpc.HealthStub(ch)
    with pytest.raises(aio.AioRpcError) as caught:
        await stub.List(health_pb2.HealthListRequest())
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    listed = await stub.List(
        health_pb2.HealthListRequest(), metadata=(("authorization", f"Bearer {ALICE}"),)
    )
    assert set(listed.statuses) == {"", "liveness", "readiness", "models/m"}
