"""`xds.service.orca.v3.OpenRcaService/StreamCoreMetrics` on the main port: the load
report out of band, for a balancer that wants it without a steady flow of calls to read
trailers from (long streams, an idle replica).

A stream gets a report at once, then one per interval: the one it asks for
(`report_interval`), never shorter than `orca.min_interval_s` (a client cannot make the
gateway report more often than it is sized for). The reports are the reporter's cached
bytes, as the trailers' are. Streams are bounded (`orca.max_streams` per serving
process; past it RESOURCE_EXHAUSTED), and all of them end (OK) when the gateway stops
serving, so a drain never waits for a balancer's stream; a stream asked for after that
is UNAVAILABLE. With API keys on, the key is checked as for any service on the port but
the engines' (the port's interceptor).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog
from grpc import aio

from gateway.orca.report import LoadReporter
from gateway.orca.v3.orca_pb2 import OrcaLoadReportRequest

log = structlog.get_logger("gateway.orca")

SERVICE_NAME = "xds.service.orca.v3.OpenRcaService"
METHOD = "StreamCoreMetrics"


def interval_s(request: OrcaLoadReportRequest, floor_s: float) -> float:
    """The stream's interval: what it asks for, at least `floor_s` (also when unset)."""
    asked = request.report_interval
    return max(asked.seconds + asked.nanos / 1e9, floor_s)


class OrcaService:
    def __init__(self, reporter: LoadReporter, min_interval_s: float, max_streams: int) -> None:
        self._reporter = reporter
        self._min_interval_s = min_interval_s
        self._max_streams = max_streams
        self.streams = 0  # open now
        self._full = False  # the cap was hit and logged, not yet relieved
        self._closed = asyncio.Event()

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

    async def stream_core_metrics(
        self, request: OrcaLoadReportRequest, context: aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        if self._closed.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
        if self.streams >= self._max_streams:
            if not self._full:
                self._full = True
                log.warning("orca streams at their cap: refusing more", max=self._max_streams)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many load report streams")
        every_s = interval_s(request, self._min_interval_s)
        self.streams += 1
        try:
            while True:
                yield self._reporter.serialized()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(every_s):
                        await self._closed.wait()
                if self._closed.is_set():
                    return
        finally:
            self.streams -= 1
            if self._full and self.streams < self._max_streams // 2:
                self._full = False
