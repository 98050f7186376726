"""scripts/otlp_sink.py as a process, sent spans by the OpenTelemetry SDK's OTLP/gRPC
exporter: with --print it shows each trace as a tree once it settles, and still counts
the spans at exit; without it, it prints its count alone. (The tree's layout:
tests/unit/scripts/test_otlp_sink.py.)"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, StatusCode

from gateway_sim.launch import START_S, Child, ready
from tests.support.launch import STOP_S
from tests.support.waits import WAIT_S

SINK = Path(__file__).resolve().parents[2] / "scripts" / "otlp_sink.py"


class Lines:
    """A process's stdout, line by line, read in a thread: waits are bounded."""

    def __init__(self, child: Child) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        stdout = child.process.stdout
        assert stdout is not None
        self._thread = threading.Thread(target=self._read, args=(stdout,), daemon=True)
        self._thread.start()

    def _read(self, stdout: TextIO) -> None:
        for line in stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def until(self, predicate: Callable[[str], bool], within_s: float = WAIT_S) -> list[str]:
        """Lines up to and including the first that matches (or the end of output)."""
        seen: list[str] = []
        while True:
            line = self._lines.get(timeout=within_s)
            if line is None:
                return seen
            seen.append(line)
            if predicate(line):
                return seen


SinkStarter = Callable[..., Child]


@pytest.fixture
def start_sink() -> Iterator[SinkStarter]:
    started: list[Child] = []

    def start(*args: str) -> Child:
        process = subprocess.Popen(
            [sys.executable, str(SINK), *args], stdout=subprocess.PIPE, text=True
        )
        child = ready(process, ["otlp_sink", *args], START_S)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


def send_a_call(port: int) -> str:
    """A call's spans as the gateway makes them (SERVER, then a placement and a failed
    and a retried upstream attempt inside it), exported in one batch at the end (as the
    gateway's batches would, and so that the trace settles once); its trace id."""
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=WAIT_S)
    provider = TracerProvider(resource=Resource.create({"service.name": "model-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=600_000))
    tracer = provider.get_tracer("test")
    try:
        with tracer.start_as_current_span(
            "sglang.grpc.scheduler.SglangScheduler/Generate", kind=SpanKind.SERVER
        ) as server:
            server.set_attribute("gateway.worker", "127.0.0.1:2")
            server.set_attribute("rpc.grpc.status_code", 0)
            with tracer.start_as_current_span("placement") as placement:
                placement.set_attribute("gateway.policy", "round_robin")
            with tracer.start_as_current_span("upstream regular", kind=SpanKind.CLIENT) as leg:
                leg.set_attributes({"gateway.worker": "127.0.0.1:1", "gateway.leg": "regular"})
                leg.set_status(StatusCode.ERROR, "worker gone")
            with tracer.start_as_current_span("upstream regular", kind=SpanKind.CLIENT) as leg:
                leg.set_attributes({"gateway.worker": "127.0.0.1:2", "gateway.leg": "regular"})
            trace_id = f"{server.get_span_context().trace_id:032x}"
    finally:
        provider.shutdown()
    return trace_id


def test_print_shows_each_trace_as_a_tree_and_the_count_at_exit(
    start_sink: SinkStarter,
) -> None:
    sink = start_sink("--print", "--settle", "0.2")
    out = Lines(sink)
    trace_id = send_a_call(sink.port)
    header = f"trace {trace_id} (model-gateway)"
    lines = out.until(lambda line: line == header)
    assert lines == [header]  # nothing before it: the trace came out whole, once settled
    tree = [out.until(lambda line: True)[0] for _ in range(4)]
    assert [line.split(" ms ")[0].rsplit(" ", 1)[0] for line in tree] == [
        "  sglang.grpc.scheduler.SglangScheduler/Generate SERVER",
        "    placement INTERNAL",
        "    upstream regular CLIENT",
        "    upstream regular CLIENT",
    ]
    assert tree[0].endswith(" gateway.worker=127.0.0.1:2 rpc.grpc.status_code=0")
    assert tree[1].endswith(" gateway.policy=round_robin")
    assert tree[2].endswith(" gateway.worker=127.0.0.1:1 gateway.leg=regular ERROR worker gone")
    assert tree[3].endswith(" gateway.worker=127.0.0.1:2 gateway.leg=regular")
    sink.process.send_signal(signal.SIGTERM)
    assert out.until(lambda line: line.startswith("spans ")) == ["spans 4"]
    assert sink.process.wait(STOP_S) == 0


def test_without_print_it_only_counts(start_sink: SinkStarter) -> None:
    sink = start_sink()
    out = Lines(sink)
    send_a_call(sink.port)
    sink.process.send_signal(signal.SIGTERM)
    assert out.until(lambda line: False) == ["spans 4"]
    assert sink.process.wait(STOP_S) == 0
