"""Bearer-token check for the admin port, as a server interceptor.

An interceptor rather than a check in each method, so nothing served on the admin port
(reflection included) can be reached without the token, including methods added later.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc
from grpc import aio

from gateway.auth import bearer, deny

MISSING = "the admin API needs the metadata 'authorization: Bearer <token>'"
REJECTED = "the admin token was not accepted"


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
        given = bearer(details.invocation_metadata)
        if given is None:
            return deny(handler, MISSING)
        if not hmac.compare_digest(given.encode(), self._token):
            return deny(handler, REJECTED)
        return handler
