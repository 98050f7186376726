"""Request metadata, read once: the routing hints and what may travel upstream."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.auth import AUTHORIZATION, bearer_token
from gateway.fleet.policies import Hints

# Hop-by-hop and transport keys that describe the client's connection, not the request.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "upgrade",
        "host",
        "user-agent",
        "content-type",
    }
)

Metadata = tuple[tuple[str, str | bytes], ...]


def forwardable(key: str) -> bool:
    return not (key in HOP_BY_HOP or key.startswith("grpc-") or key.startswith(":"))


def clean(metadata: Iterable[tuple[str, str | bytes]] | None) -> Metadata:
    """Metadata a peer may see: without hop-by-hop, pseudo and grpc-* keys."""
    if not metadata:
        return ()
    return tuple((k, v) for k, v in metadata if forwardable(k))


def forwardable_value(key: str, value: str | bytes) -> bool:
    """What a grpc channel accepts: printable ASCII (space to tilde), any bytes in -bin
    keys. grpc core refuses anything else when the call starts, locally."""
    if isinstance(value, bytes):
        return key.endswith("-bin")
    return key.endswith("-bin") or (value.isascii() and value.isprintable())


@dataclass(frozen=True, slots=True)
class RequestMeta:
    model: str | None
    hints: Hints
    forward: Metadata
    bad_key: str | None = None  # the first key whose value cannot go upstream
    bearer: str | None = None  # X of `authorization: Bearer X` (the API key), never forwarded
    flow: tuple[str | None, str | None] = (None, None)  # (priority class, tenant) asked for


def read_request_meta(
    metadata: Sequence[tuple[str, str | bytes]] | None,
    model_headers: Sequence[str],
    routing_key_header: str,
    target_worker_header: str,
    private_keys: frozenset[str] = frozenset(),
    flow_headers: tuple[str, str] = ("", ""),
) -> RequestMeta:
    """Routing hints, the caller's bearer token, and what goes upstream: forwardable keys
    but `private_keys` (the caller's own credentials, which are the gateway's business,
    not the workers'). `flow_headers`: the priority and tenant headers (flow control)."""
    priority_header, tenant_header = flow_headers
    priority: str | None = None
    tenant: str | None = None
    model: str | None = None
    model_rank = len(model_headers)
    routing_key: str | None = None
    target: str | None = None
    token: str | None = None
    forward: list[tuple[str, str | bytes]] = []
    bad_key: str | None = None
    for key, value in metadata or ():
        if key == AUTHORIZATION and token is None and isinstance(value, str):
            token = bearer_token(value)
        if not forwardable(key) or key in private_keys:
            continue
        if bad_key is None and not forwardable_value(key, value):
            bad_key = key
        forward.append((key, value))
        if isinstance(value, bytes):
            continue
        if key in model_headers:
            rank = model_headers.index(key)
            if rank < model_rank:
                model, model_rank = value, rank
        elif key == routing_key_header:
            routing_key = value
        elif key == target_worker_header:
            target = value
        elif key == priority_header and priority is None:
            priority = value
        elif key == tenant_header and tenant is None:
            tenant = value
    return RequestMeta(
        model=model or None,
        hints=Hints(routing_key=routing_key, target_worker=target),
        forward=tuple(forward),
        bad_key=bad_key,
        bearer=token,
        flow=(priority, tenant),
    )
