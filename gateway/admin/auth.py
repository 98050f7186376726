"""Bearer-token check for the admin port, as a server interceptor.

An interceptor rather than a check in each method, so nothing served on the admin port
(reflection included) can be reached without the token, including methods added later.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc import aio

AUTHORIZATION = "authorization"
MISSING = "the admin API needs the metadata 'authorization: Bearer <token>'"
REJECTED = "the admin token was not accepted"


def _bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses the call."""

    async def refuse(_request: Any, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **codecs)
    return grpc.unary_unary_rpc_method_handler(refuse, **codecs)


class BearerTokenInterceptor(aio.ServerInterceptor):  # type: ignore[misc]
    """Every call must carry `authorization: Bearer <token>`, else UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        given = _bearer(details.invocation_metadata)
        if given is None:
            return _deny(handler, MISSING)
        if not hmac.compare_digest(given.encode(), self._token):
            return _deny(handler, REJECTED)
        return handler
