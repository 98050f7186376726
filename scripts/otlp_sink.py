"""A minimal OTLP/gRPC trace receiver: accepts `TraceService/Export` and counts the spans.
Prints `READY <port>`; on SIGTERM or SIGINT prints `spans <count>` and exits.

Without --print it keeps nothing (the benchmarks' sink). With --print it also prints
every trace it receives as an indented tree, so the gateway's traces can be read without
a collector: a trace is printed once no span of it arrived for `--settle` seconds (the
gateway exports in batches, a second apart by default), and whatever is left at exit.
One line a span: name, kind, duration, a few key attributes, its error if it failed;
a span whose parent was not received (a client's own span, or one printed before) says
which parent it names.

    python scripts/otlp_sink.py [--listen 127.0.0.1:0] [--print [--settle S]]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpc import aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

# The attributes a line shows, when the span has them (the gateway's; see
# docs/observability.md, "Traces").
KEY_ATTRIBUTES = (
    "gen_ai.request.model",
    "gateway.worker",
    "gateway.leg",
    "gateway.attempt",
    "gateway.policy",
    "gateway.verdict",
    "gateway.reason",
    "gateway.outcome",
    "rpc.grpc.status_code",
)
SETTLE_S = 2.0
INDENT = "  "


@dataclass(frozen=True, slots=True)
class Received:
    """A span and the service (resource `service.name`) that sent it."""

    service: str
    span: trace_pb2.Span


def plain(value: common_pb2.AnyValue) -> Any:
    """An OTLP attribute value as Python data."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [plain(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {item.key: plain(item.value) for item in value.kvlist_value.values}
    return getattr(value, kind)


def _attributes(items: Sequence[common_pb2.KeyValue]) -> dict[str, Any]:
    return {item.key: plain(item.value) for item in items}


def span_line(span: trace_pb2.Span, parent_missing: bool) -> str:
    """`name KIND 12.3 ms key=value ... [ERROR message] [parent ID]`."""
    kind = trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_")
    duration_ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
    words = [span.name, kind, f"{duration_ms:.1f} ms"]
    attributes = _attributes(span.attributes)
    words += [f"{key}={attributes[key]}" for key in KEY_ATTRIBUTES if key in attributes]
    if span.status.code == trace_pb2.Status.STATUS_CODE_ERROR:
        words.append(f"ERROR {span.status.message}".rstrip())
    if parent_missing:
        words.append(f"(parent {span.parent_span_id.hex()})")
    return " ".join(words)


def trace_tree(received: Sequence[Received]) -> list[str]:
    """One trace's spans as lines: a header, then each span under its parent (by start
    time among siblings). A span whose parent is not among them is a root."""
    spans = [r.span for r in received]
    ids = {span.span_id for span in spans}
    children: dict[bytes, list[trace_pb2.Span]] = {}
    roots = []
    for span in sorted(spans, key=lambda s: (s.start_time_unix_nano, s.span_id)):
        if span.parent_span_id and span.parent_span_id in ids:
            children.setdefault(span.parent_span_id, []).append(span)
        else:
            roots.append(span)
    services = sorted({r.service for r in received if r.service})
    header = f"trace {spans[0].trace_id.hex()}" + (f" ({', '.join(services)})" if services else "")
    lines = [header]

    def walk(span: trace_pb2.Span, depth: int) -> None:
        missing = depth == 1 and bool(span.parent_span_id)
        lines.append(INDENT * depth + span_line(span, missing))
        for child in children.get(span.span_id, ()):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 1)
    return lines


def received_spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Received]:
    found = []
    for resource in request.resource_spans:
        service = _attributes(resource.resource.attributes).get("service.name", "")
        for scope in resource.scope_spans:
            found += [Received(str(service), span) for span in scope.spans]
    return found


class Traces:
    """Spans held by trace until the trace settles (no new span for `settle_s`), then
    handed to `emit` as a tree's lines."""

    def __init__(self, settle_s: float, emit: Callable[[list[str]], None]) -> None:
        self._settle_s = settle_s
        self._emit = emit
        self._pending: dict[bytes, list[Received]] = {}
        self._timers: dict[bytes, asyncio.TimerHandle] = {}

    def add(self, spans: Sequence[Received]) -> None:
        loop = asyncio.get_running_loop()
        for item in spans:
            trace_id = item.span.trace_id
            self._pending.setdefault(trace_id, []).append(item)
            timer = self._timers.pop(trace_id, None)
            if timer is not None:
                timer.cancel()
            self._timers[trace_id] = loop.call_later(self._settle_s, self.flush, trace_id)

    def flush(self, trace_id: bytes) -> None:
        timer = self._timers.pop(trace_id, None)
        if timer is not None:
            timer.cancel()
        spans = self._pending.pop(trace_id, None)
        if spans:
            self._emit(trace_tree(spans))

    def flush_all(self) -> None:
        for trace_id in list(self._pending):  # in the order they first arrived
            self.flush(trace_id)


def _print_lines(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, traces: Traces | None = None) -> None:
        self.spans = 0
        self.traces = traces

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans += len(scope.spans)
        if self.traces is not None:
            self.traces.add(received_spans(request))
        return trace_service_pb2.ExportTraceServiceResponse()


async def main(listen: str, show: bool = False, settle_s: float = SETTLE_S) -> None:
    server = aio.server()
    traces = Traces(settle_s, _print_lines) if show else None
    sink = Sink(traces)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(listen)
    await server.start()
    print(f"READY {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(None)
    if traces is not None:
        traces.flush_all()
    print(f"spans {sink.spans}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument(
        "--print",
        dest="show",
        action="store_true",
        help="print each trace as an indented tree of its spans",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        metavar="S",
        help=f"with --print: print a trace once no span of it came for S s (default {SETTLE_S:g})",
    )
    args = parser.parse_args()
    asyncio.run(main(args.listen, args.show, args.settle))
