"""The bearer token of a call's metadata, and the interceptor that requires one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc import aio

from gateway.security.handlers import deny

AUTHORIZATION = "authorization"


def bearer_token(value: str) -> str | None:
    """X of an `authorization: Bearer X` value."""
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            token = bearer_token(value)
            if token is not None:
                return token
    return None


class BearerInterceptor(aio.ServerInterceptor):  # type: ignore[misc]
    """Every call (but those under `open_prefixes`) must carry `authorization: Bearer X`
    with an X that `accepts`, else UNAUTHENTICATED. An interceptor rather than a check in
    each method, so nothing served can be reached without it, methods added later too."""

    def __init__(
        self,
        accepts: Callable[[str], bool],
        missing: str,
        rejected: str,
        open_prefixes: tuple[str, ...] = (),
    ) -> None:
        self._accepts = accepts
        self._missing, self._rejected = missing, rejected
        self._open = open_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or (self._open and details.method.startswith(self._open)):
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        given = bearer(details.invocation_metadata)
        if given is None:
            return deny(handler, self._missing)
        if not self._accepts(given):
            return deny(handler, self._rejected)
        return handler
