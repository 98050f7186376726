"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


CLIENT_SPAN = "00f067aa0ba902b7"


TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@contextlib.asynccontextmanager
async def receiver() -> AsyncIterator[tuple[Receiver, aio.Server, int]]:
    server = aio.server()
    kept = Receiver()
    # opentelemetry-proto's generated gRPC module is unannotated.
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(kept, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield kept, server, port
    finally:
        await server.stop(None)


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        kind = value.WhichOneof("value")
        if kind == "array_value":
            return [plain(v) for v in value.array_value.values]
        return getattr(value, kind)

    return {item.key: plain(item.value) for item in span.attributes}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, prefix: str) -> list[trace_pb2.Span]:
        return [s for s in self.spans if s.name.startswith(prefix)]
