"""`xds.service.orca.v3.OpenRcaService/StreamCoreMetrics` on the main port: the load
report out of band, for a balancer that wants it without a steady flow of calls to read
trailers from (long streams, an idle replica).

A stream gets a report at once, then one per interval: the one it asks for
(`report_interval`), never shorter than `orca.min_interval_s` (a client cannot make the
gateway report more often than it is sized for). The reports are the reporter's cached
bytes, as the trailers' are. All of them end (OK) when the gateway stops serving, so a
drain never waits for a balancer's stream; a stream asked for after that is UNAVAILABLE.
With API keys on, the key is checked as for any service on the port but the engines'
(the port's interceptor).

Streams are bounded per serving process, and shared out (`StreamShares`): at most
`orca.max_streams` in all, `orca.max_streams_per_connection` on one client connection
(`context.peer()`, its address and port) and `orca.max_streams_per_peer` for one
principal (API key, client certificate; else the peer's address, as the engine calls'
admission shares go), so one client cannot hold every stream and leave the other
balancers without load reports. A stream past a share is refused RESOURCE_EXHAUSTED, its
message naming the share; refusals are counted and logged at a bounded rate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from enum import Enum

import grpc
import structlog
from grpc import aio

from gateway.config import OrcaConfig
from gateway.core.address import peer_host
from gateway.observability.logs import Throttle
from gateway.orca.report import OrcaReporter
from gateway.orca.v3.orca_pb2 import OrcaLoadReportRequest
from gateway.security.identity import Identities

log = structlog.get_logger("gateway.orca")

SERVICE_NAME = "xds.service.orca.v3.OpenRcaService"
METHOD = "StreamCoreMetrics"


class Share(Enum):
    """The bound a refused stream met (the metric's `share` label)."""

    GATEWAY = "gateway"
    CONNECTION = "connection"
    PEER = "peer"


REFUSALS = {
    Share.GATEWAY: "too many load report streams on this gateway process "
    "(orca.max_streams: {limit})",
    Share.CONNECTION: "too many load report streams on this connection "
    "(orca.max_streams_per_connection: {limit})",
    Share.PEER: "too many load report streams for this caller: its API key or client "
    "certificate, else its address (orca.max_streams_per_peer: {limit})",
}


def interval_s(request: OrcaLoadReportRequest, floor_s: float) -> float:
    """The stream's interval: what it asks for, at least `floor_s` (also when unset)."""
    asked = request.report_interval
    return max(asked.seconds + asked.nanos / 1e9, floor_s)


class StreamShares:
    """Streams open now: in all, by connection and by owner (principal or peer address),
    each bounded. Counts of nobody are not kept (a connection or owner with no stream has
    no entry)."""

    __slots__ = ("_by_connection", "_by_owner", "limits", "open")

    def __init__(self, total: int, per_connection: int, per_owner: int) -> None:
        self.limits = {
            Share.GATEWAY: total,
            Share.CONNECTION: per_connection,
            Share.PEER: per_owner,
        }
        self.open = 0
        self._by_connection: dict[str, int] = {}
        self._by_owner: dict[str, int] = {}

    def enter(self, connection: str, owner: str) -> Share | None:
        """Count a stream in, or say which share is full (then nothing is counted)."""
        limits = self.limits
        if self.open >= limits[Share.GATEWAY]:
            return Share.GATEWAY
        if self._by_connection.get(connection, 0) >= limits[Share.CONNECTION]:
            return Share.CONNECTION
        if self._by_owner.get(owner, 0) >= limits[Share.PEER]:
            return Share.PEER
        self.open += 1
        _add(self._by_connection, connection, 1)
        _add(self._by_owner, owner, 1)
        return None

    def leave(self, connection: str, owner: str) -> None:
        self.open -= 1
        _add(self._by_connection, connection, -1)
        _add(self._by_owner, owner, -1)

    def held(self, connection: str | None = None, owner: str | None = None) -> int:
        """Streams open on `connection`, or of `owner`; with neither: connections and
        owners that hold any (0 once every stream ended)."""
        if connection is not None:
            return self._by_connection.get(connection, 0)
        if owner is not None:
            return self._by_owner.get(owner, 0)
        return len(self._by_connection) + len(self._by_owner)


def _add(counts: dict[str, int], key: str, change: int) -> None:
    count = counts.get(key, 0) + change
    if count:
        counts[key] = count
    else:
        del counts[key]


class OrcaService:
    """`refused(share)` hears every refusal (metrics); `identities` names a stream's
    principal (None: streams are shared by peer address)."""

    def __init__(
        self,
        reporter: OrcaReporter,
        config: OrcaConfig,
        identities: Identities | None = None,
        refused: Callable[[str], None] | None = None,
    ) -> None:
        self._reporter = reporter
        self._min_interval_s = config.min_interval_s
        self.shares = StreamShares(
            config.max_streams, config.max_streams_per_connection, config.peer_share
        )
        self._identities = identities
        self._refused = refused
        self._lines = Throttle(1.0, 5)  # refusal lines: a client may cause one per call
        self._closed = asyncio.Event()

    @property
    def streams(self) -> int:
        """Streams open now."""
        return self.shares.open

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's one method; replies are the reporter's bytes as they are."""
        method = grpc.unary_stream_rpc_method_handler(
            self.stream_core_metrics,
            request_deserializer=OrcaLoadReportRequest.FromString,
            response_serializer=None,
        )
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {METHOD: method})

    def close_streams(self) -> None:
        """The gateway stops serving: every stream ends now, and new ones are refused."""
        self._closed.set()

    def owner(self, context: aio.ServicerContext) -> str:
        """Whose share a stream uses: its principal, else `peer:` its peer's address (as
        the engine calls' admission names callers)."""
        known = self._identities
        principal = known.principal(context) if known is not None else None
        return principal if principal is not None else "peer:" + peer_host(context.peer())

    async def stream_core_metrics(
        self, request: OrcaLoadReportRequest, context: aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if self._closed.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
        every_s = interval_s(request, self._min_interval_s)
        connection, owner = context.peer(), self.owner(context)
        full = self.shares.enter(connection, owner)
        if full is not None:
            await self._refuse(context, full, connection, owner)
        try:
            while True:
                yield self._reporter.serialized()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(every_s):
                        await self._closed.wait()
                if self._closed.is_set():
                    return
        finally:
            self.shares.leave(connection, owner)

    async def _refuse(
        self, context: aio.ServicerContext, share: Share, connection: str, owner: str
    ) -> None:
        limit = self.shares.limits[share]
        if self._refused is not None:
            self._refused(share.value)
        held = self._lines.take()
        if held is not None:
            log.warning(
                "orca_stream_refused",
                share=share.value,
                limit=limit,
                peer=connection,
                owner=owner,
                open=self.shares.open,
                suppressed=held,
            )
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSALS[share].format(limit=limit))
