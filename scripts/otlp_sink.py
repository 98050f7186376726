"""A minimal OTLP/gRPC trace receiver for benchmarks: accepts `TraceService/Export`,
counts the spans, keeps nothing. Prints `READY <port>`; on SIGTERM prints the count.

    python scripts/otlp_sink.py [--listen 127.0.0.1:0]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from grpc import aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans += len(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def main(listen: str) -> None:
    server = aio.server()
    sink = Sink()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port(listen)
    await server.start()
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(None)
    print(f"spans {sink.spans}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:0")
    asyncio.run(main(parser.parse_args().listen))
