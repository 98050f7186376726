"""scripts/otlp_sink.py --print: a trace's spans as an indented tree (parents from span
ids), one line a span with its kind, duration and key attributes. (The receiver as a
process, fed over OTLP: tests/e2e/test_otlp_sink.py.)"""

from __future__ import annotations

import asyncio

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from scripts.otlp_sink import Received, Traces, trace_tree

TRACE = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
CLIENT = bytes.fromhex("00f067aa0ba902b7")


def span(
    name: str,
    span_id: int,
    parent: bytes,
    start_ms: float,
    end_ms: float,
    kind: trace_pb2.Span.SpanKind.ValueType = trace_pb2.Span.SPAN_KIND_INTERNAL,
    trace_id: bytes = TRACE,
    **attributes: str | int,
) -> trace_pb2.Span:
    made = trace_pb2.Span(
        trace_id=trace_id,
        span_id=span_id.to_bytes(8, "big"),
        parent_span_id=parent,
        name=name,
        kind=kind,
        start_time_unix_nano=int(start_ms * 1e6),
        end_time_unix_nano=int(end_ms * 1e6),
    )
    for key, value in attributes.items():
        any_value = (
            common_pb2.AnyValue(int_value=value)
            if isinstance(value, int)
            else common_pb2.AnyValue(string_value=value)
        )
        made.attributes.append(common_pb2.KeyValue(key=key.replace("__", "."), value=any_value))
    return made


def gateway_call() -> list[trace_pb2.Span]:
    """A gateway's call as it exports it: children first (they end first), then the
    SERVER span, whose parent is the client's own span (never sent)."""
    server = span(
        "sglang.grpc.scheduler.SglangScheduler/Generate", 1, CLIENT, 0.0, 12.5,
        trace_pb2.Span.SPAN_KIND_SERVER, gateway__worker="w:1", rpc__grpc__status_code=0,
    )  # fmt: skip
    first = span(
        "upstream regular", 3, server.span_id, 1.0, 4.0, trace_pb2.Span.SPAN_KIND_CLIENT,
        gateway__worker="w:1", gateway__leg="regular", rpc__grpc__status_code=14,
    )  # fmt: skip
    first.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    first.status.message = "worker gone"
    retry = span(
        "upstream regular", 4, server.span_id, 5.0, 12.0, trace_pb2.Span.SPAN_KIND_CLIENT,
        gateway__worker="w:2", gateway__leg="regular", rpc__grpc__status_code=0,
    )  # fmt: skip
    placement = span("placement", 2, server.span_id, 0.5, 0.7, gateway__policy="round_robin")
    return [retry, placement, first, server]


def test_a_call_prints_as_a_tree_under_its_server_span() -> None:
    lines = trace_tree([Received("model-gateway", s) for s in gateway_call()])
    assert lines == [
        f"trace {TRACE.hex()} (model-gateway)",
        "  sglang.grpc.scheduler.SglangScheduler/Generate SERVER 12.5 ms gateway.worker=w:1"
        f" rpc.grpc.status_code=0 (parent {CLIENT.hex()})",
        "    placement INTERNAL 0.2 ms gateway.policy=round_robin",
        "    upstream regular CLIENT 3.0 ms gateway.worker=w:1 gateway.leg=regular"
        " rpc.grpc.status_code=14 ERROR worker gone",
        "    upstream regular CLIENT 7.0 ms gateway.worker=w:2 gateway.leg=regular"
        " rpc.grpc.status_code=0",
    ]


def test_a_root_span_names_no_parent_and_grandchildren_indent_further() -> None:
    root = span("root", 1, b"", 0.0, 3.0)
    child = span("child", 2, root.span_id, 1.0, 2.0)
    grandchild = span("grandchild", 3, child.span_id, 1.5, 1.6)
    lines = trace_tree([Received("", s) for s in (grandchild, child, root)])
    assert lines == [
        f"trace {TRACE.hex()}",
        "  root INTERNAL 3.0 ms",
        "    child INTERNAL 1.0 ms",
        "      grandchild INTERNAL 0.1 ms",
    ]


def test_a_trace_is_printed_once_it_settles_and_whatever_is_left_at_the_end() -> None:
    other = bytes.fromhex("11" * 16)

    async def scenario() -> list[list[str]]:
        printed: list[list[str]] = []
        both = asyncio.Event()

        def emit(lines: list[str]) -> None:
            printed.append(lines)
            if len(printed) == 2:
                both.set()

        traces = Traces(0.05, emit)
        calls = gateway_call()
        traces.add([Received("gw", s) for s in calls[:2]])
        traces.add([Received("gw", s) for s in calls[2:]])  # the same trace, later
        traces.add([Received("gw", span("alone", 9, b"", 0.0, 1.0, trace_id=other))])
        await asyncio.wait_for(both.wait(), 5)  # each settles 0.05 s after its last span
        traces.add([Received("gw", span("late", 10, b"", 0.0, 1.0, trace_id=other))])
        traces.flush_all()
        return printed

    printed = asyncio.run(scenario())
    assert [len(lines) for lines in printed] == [5, 2, 2]  # one tree a trace, then the rest
    assert printed[0][0] == f"trace {TRACE.hex()} (gw)"
    assert printed[1][1:] == ["  alone INTERNAL 1.0 ms"]
    assert printed[2][1:] == ["  late INTERNAL 1.0 ms"]
