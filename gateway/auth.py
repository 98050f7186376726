"""Who is calling: API keys on the main port, and the caller's principal.

The principal is the client certificate's identity (mTLS), else the name of the API key
the call carried, else none. It scopes what a caller may touch: an Abort reaches only
requests its own principal started.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from gateway.config import ConfigError

AUTHORIZATION = "authorization"
# Always open: load balancers probe health, and `grpcurl list` needs reflection.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MISSING_KEY = "this gateway needs the metadata 'authorization: Bearer <API key>'"
REJECTED_KEY = "the API key was not accepted"


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


def deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
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


class ApiKeys:
    """`name:key` lines; blank lines and `#` comments ignored."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._by_key = {key.encode(): name for name, key in keys.items()}

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"auth.api_keys_file {path!r}: {exc.strerror or exc}") from None
        keys: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, key = line.partition(":")
            if not sep or not name.strip() or len(key.strip()) < 16:
                raise ConfigError(
                    f"auth.api_keys_file {path!r} line {number}: expected name:key "
                    "(a key of 16 characters or more)"
                )
            keys[name.strip()] = key.strip()
        if not keys:
            raise ConfigError(f"auth.api_keys_file {path!r} has no keys")
        return cls(keys)

    def name_of(self, given: str | None) -> str | None:
        """The key's name, or None if it is not a key (constant time per key)."""
        if given is None:
            return None
        found = None
        for key, name in self._by_key.items():
            if hmac.compare_digest(given.encode(), key):
                found = name
        return found


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


def api_key_interceptor(keys: ApiKeys) -> BearerInterceptor:
    """The main port: a known API key on every call but health and reflection."""
    return BearerInterceptor(
        lambda given: keys.name_of(given) is not None, MISSING_KEY, REJECTED_KEY, OPEN_PREFIXES
    )


class Caller:
    """Tells who a call comes from, where the gateway knows callers at all (client
    certificates or API keys); everyone is nobody otherwise, at no cost per call."""

    def __init__(self, keys: ApiKeys | None = None, certificates: bool = False) -> None:
        self._keys = keys
        self._certificates = certificates
        self.known = keys is not None or certificates
        # The API key authenticates the caller to the gateway: it never goes upstream.
        self.private_keys = frozenset({AUTHORIZATION}) if keys is not None else frozenset()

    def principal(self, context: aio.ServicerContext) -> str | None:
        """The client certificate's name (mTLS), else the API key's name, else None."""
        if not self.known:
            return None
        if self._certificates:
            auth = context.auth_context() or {}
            for field in ("x509_common_name", "x509_subject_alternative_name"):
                values = auth.get(field)
                if values:
                    return "cert:" + bytes(values[0]).decode(errors="replace")
        if self._keys is not None:
            name = self._keys.name_of(bearer(context.invocation_metadata()))
            if name is not None:
                return "key:" + name
        return None
