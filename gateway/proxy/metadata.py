"""Metadata both ways: a request's, read once (the routing hints and what may travel
upstream), and a worker's headers and trailers as they are relayed to the client.

What is relayed is bounded: a client's grpc refuses a header block over 8 KiB at random
(its soft limit; over 16 KiB always), counting each entry as HTTP/2 does (key + value +
32), and the gateway's own trailers (the load report, the status) share the trailers'
block. So a worker's headers, and its trailers, are cut to `upstream.
max_relayed_metadata_entries` entries and `upstream.max_relayed_metadata_bytes` bytes
(4 KiB), and its status message to `MAX_RELAYED_DETAILS`; what is dropped is counted and
logged at a bounded rate. An OK answer does not relay a worker's keys that describe a
failure (`FAILURE_ONLY`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import structlog

from gateway.core.slo import parse_ms
from gateway.observability.logs import Throttle
from gateway.placement.affinity import session_key
from gateway.placement.policies import Hints
from gateway.security.bearer import AUTHORIZATION, bearer_token

log = structlog.get_logger("gateway.proxy")

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
    session: str | None = None  # the session it belongs to (affinity on; see `session_key`)
    slo: tuple[float | None, float | None] = (None, None)  # seconds: (to first, per token)
    bad_slo: str | None = None  # the objective header whose value is no such time


UNREAD = RequestMeta(model=None, hints=Hints(), forward=())  # a call's, before `open` reads it


def read_request_meta(
    metadata: Sequence[tuple[str, str | bytes]] | None,
    model_headers: Sequence[str],
    routing_key_header: str,
    target_worker_header: str,
    private_keys: frozenset[str] = frozenset(),
    flow_headers: tuple[str, str] = ("", ""),
    session_header: str = "",
    slo_headers: tuple[str, str] = ("", ""),
) -> RequestMeta:
    """Routing hints, the caller's bearer token, and what goes upstream: forwardable keys
    but `private_keys` (the caller's own credentials, which are the gateway's business,
    not the workers'). `flow_headers`: the priority and tenant headers (flow control).
    `session_header` (affinity on): the header naming the call's session, which is also
    its routing key when it has none of its own (so `consistent_hash` places a session's
    first call alike in every serving process and replica). `slo_headers`: the headers
    of the call's latency objectives (time to first token, per output token)."""
    priority_header, tenant_header = flow_headers
    ttft_header, tpot_header = slo_headers
    slo: list[float | None] = [None, None]
    bad_slo: str | None = None
    priority: str | None = None
    tenant: str | None = None
    model: str | None = None
    model_rank = len(model_headers)
    routing_key: str | None = None
    target: str | None = None
    session: str | None = None
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
        if key == session_header and session is None:
            session = session_key(value)
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
        elif key in (ttft_header, tpot_header):
            seconds = parse_ms(value)
            if seconds is None:
                bad_slo = bad_slo or key
            slo[key == tpot_header] = seconds
    return RequestMeta(
        model=model or None,
        hints=Hints(
            routing_key=routing_key if routing_key is not None else session, target_worker=target
        ),
        forward=tuple(forward),
        bad_key=bad_key,
        bearer=token,
        flow=(priority, tenant),
        session=session,
        slo=(slo[0], slo[1]),
        bad_slo=bad_slo,
    )


# -- relayed back: a worker's headers and trailers ------------------------------------------

HEADERS, TRAILERS = "headers", "trailers"  # what is relayed (the metric's `kind`)
KINDS = (HEADERS, TRAILERS)
ENTRY_OVERHEAD = 32  # octets HTTP/2 counts per entry beyond its key and value (RFC 9113)
# A worker's keys that describe a failure: relayed with one, never with an OK answer (a
# client reading `x-http-status` there would see an error that did not happen).
# `grpc-status-details-bin` never passes `clean` (a grpc-* key), failure or not.
FAILURE_ONLY = frozenset({"x-http-status", "grpc-status-details-bin"})
# A worker's status message goes out as `grpc-message`, in the trailers' block: at most
# this many UTF-8 bytes of it (percent-encoded on the wire, at most 3 KiB).
MAX_RELAYED_DETAILS = 1024
CUT = "..."


def entry_size(key: str, value: str | bytes) -> int:
    """What an entry weighs against a peer's metadata limit, as grpc core counts it: key
    and value octets plus 32; a binary value as it travels (base64, unpadded)."""
    if isinstance(value, bytes):
        size = (len(value) * 4 + 2) // 3
    else:
        size = len(value) if value.isascii() else len(value.encode())
    return len(key) + size + ENTRY_OVERHEAD


def bounded(metadata: Metadata, max_bytes: int, max_entries: int) -> tuple[Metadata, int]:
    """The entries that fit, in their order: each one kept while the count and the bytes
    left allow it (a big one is dropped, smaller ones after it are still kept); and how
    many were dropped."""
    kept: list[tuple[str, str | bytes]] = []
    left = max_bytes
    for key, value in metadata:
        size = entry_size(key, value)
        if size <= left and len(kept) < max_entries:
            kept.append((key, value))
            left -= size
    if len(kept) == len(metadata):
        return metadata, 0
    return tuple(kept), len(metadata) - len(kept)


def bounded_details(details: str, max_bytes: int = MAX_RELAYED_DETAILS) -> str:
    """A worker's status message as relayed: at most `max_bytes` UTF-8 bytes, a longer one
    cut (and ending in "...")."""
    if len(details) <= max_bytes and details.isascii():
        return details
    raw = details.encode(errors="replace")
    if len(raw) <= max_bytes:
        return details
    return raw[: max_bytes - len(CUT)].decode(errors="ignore") + CUT


class MetadataRelay:
    """What of a worker's headers and trailers reaches the client (see the module's
    docstring). `dropped`: entries left out so far, by kind (the metric
    `gateway_relayed_metadata_dropped_total`); a line per cut, at most one a second after
    a burst of five (a worker may cause one on every call)."""

    def __init__(self, max_bytes: int = 4096, max_entries: int = 64) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.dropped = dict.fromkeys(KINDS, 0)
        self._lines = Throttle(1.0, 5)

    def headers(self, metadata: Iterable[tuple[str, str | bytes]] | None, worker: str) -> Metadata:
        """A worker's response headers, as the client gets them."""
        return self._bounded(HEADERS, clean(metadata), worker)

    def trailers(
        self, metadata: Iterable[tuple[str, str | bytes]] | None, worker: str, *, failed: bool
    ) -> Metadata:
        """A worker's trailers, as the client gets them: of an OK answer (`failed`
        False), without the keys that describe a failure."""
        relayed = clean(metadata)
        if not failed and relayed:
            relayed = tuple(kv for kv in relayed if kv[0] not in FAILURE_ONLY)
        return self._bounded(TRAILERS, relayed, worker)

    def _bounded(self, kind: str, metadata: Metadata, worker: str) -> Metadata:
        if not metadata:
            return metadata
        kept, dropped = bounded(metadata, self.max_bytes, self.max_entries)
        if dropped:
            self.dropped[kind] += dropped
            held = self._lines.take()
            if held is not None:
                log.warning(
                    "relayed_metadata_dropped",
                    kind=kind,
                    worker=worker,
                    dropped=dropped,
                    kept=len(kept),
                    max_bytes=self.max_bytes,
                    max_entries=self.max_entries,
                    suppressed=held,
                )
        return kept
