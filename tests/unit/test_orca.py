"""ORCA load reports: the report's fields from given totals, the reporter's window and
cache, the trailer added once however a call ends, and the out-of-band interval."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from gateway.config import build_config
from gateway.orca.report import IN_FLIGHT, QUEUE_DEPTH, LoadReporter, Sample, load_report
from gateway.orca.service import interval_s
from gateway.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from gateway.orca.v3.orca_pb2 import OrcaLoadReportRequest
from gateway.proxy.admission import Admission
from gateway.proxy.reporting import LOAD_TRAILER, Reporting
from gateway.record import CallRecord


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_report_is_the_change_between_two_samples() -> None:
    older = Sample(at=10.0, cpu_s=1.0, calls=5, errors=1, busy=2.0)
    newer = Sample(at=12.0, cpu_s=2.0, calls=25, errors=3, busy=6.0)
    report = load_report(older, newer, cores=2, capacity=8, in_flight=3, queued=4)
    assert report.cpu_utilization == 0.25  # 1 CPU-second in 2 s, of 2 cores
    assert report.application_utilization == 0.25  # 2 calls in flight on average, of 8
    assert report.rps_fractional == 10.0
    assert report.eps == 1.0
    assert dict(report.named_metrics) == {IN_FLIGHT: 3.0, QUEUE_DEPTH: 4.0}
    assert report.mem_utilization == 0 and report.rps == 0  # not reported


def test_without_flow_control_there_is_no_queue_depth_and_no_interval_no_rates() -> None:
    same = Sample(at=10.0, cpu_s=1.0, calls=5, errors=1, busy=2.0)
    report = load_report(same, same, cores=1, capacity=4, in_flight=0, queued=None)
    assert report.cpu_utilization == 0 and report.application_utilization == 0
    assert report.rps_fractional == 0 and report.eps == 0
    assert dict(report.named_metrics) == {IN_FLIGHT: 0.0}


def test_busy_integrates_calls_in_flight_over_time() -> None:
    clock = Clock(0.0)
    admission = Admission(10, clock=clock)
    assert admission.enter("a") is None
    clock.now = 1.0
    assert admission.enter("b") is None
    clock.now = 3.0
    admission.leave("a")
    clock.now = 4.0
    assert admission.busy() == 1.0 + 2 * 2.0 + 1.0  # one call 1 s, two for 2 s, one for 1 s


def record(code: str = "OK") -> CallRecord:
    return CallRecord(rpc="Generate", service="s", code=code)


def decoded(reporter: LoadReporter) -> OrcaLoadReport:
    return OrcaLoadReport.FromString(reporter.serialized())


def test_the_reporter_counts_calls_and_failures_over_its_window() -> None:
    clock, cpu = Clock(100.0), Clock(50.0)
    admission = Admission(4, clock=clock)
    reporter = LoadReporter(admission, None, cores=2, clock=clock, cpu_clock=cpu)
    admission.enter("a")
    clock.now, cpu.now = 102.0, 51.0
    for code in ("OK", "OK", "CANCELLED", "UNAVAILABLE"):
        reporter.observe(record(code))
    report = decoded(reporter)
    assert report.rps_fractional == 2.0  # 4 calls in 2 s
    assert report.eps == 0.5  # UNAVAILABLE fails; the client's CANCELLED does not
    assert report.cpu_utilization == 0.25
    assert report.application_utilization == 0.25  # 1 call in flight of 4
    assert report.named_metrics[IN_FLIGHT] == 1


class Rooms:
    """Flow control's queues, as the reporter reads them."""

    def depth(self) -> dict[tuple[str, str], int]:
        return {("m", "standard"): 2, ("m", "batch"): 3, ("n", "standard"): 1}


def test_with_flow_control_the_queue_depth_is_every_waiting_call() -> None:
    clock = Clock(100.0)
    rooms: Any = Rooms()
    reporter = LoadReporter(Admission(4, clock=clock), rooms, cores=1, clock=clock)
    assert decoded(reporter).named_metrics[QUEUE_DEPTH] == 6


def test_the_serialized_report_is_kept_for_the_refresh_period() -> None:
    clock = Clock(100.0)
    admission = Admission(4, clock=clock)
    reporter = LoadReporter(admission, None, cores=1, clock=clock, cpu_clock=Clock(0.0))
    clock.now = 101.0
    first = reporter.trailer()
    assert first[0] == LOAD_TRAILER
    reporter.observe(record())
    clock.now = 101.09
    assert reporter.trailer() is first  # the same bytes, not built again
    clock.now = 101.1
    assert decoded(reporter).rps_fractional == pytest.approx(1 / 1.1)


def test_the_window_keeps_the_newest_sample_a_window_old() -> None:
    clock = Clock(0.0)
    admission = Admission(4, clock=clock)
    reporter = LoadReporter(
        admission, None, cores=1, clock=clock, cpu_clock=Clock(0.0), refresh_s=0.05
    )
    for step in range(1, 31):  # a call ends every 0.1 s, a report is asked for each time
        clock.now = step / 10
        reporter.observe(record())
        report = decoded(reporter)
    # At 3.0 s the report spans 2.0 s .. 3.0 s: 10 calls in 1 s.
    assert report.rps_fractional == pytest.approx(10.0)


def test_an_idle_gap_is_not_averaged_into_the_next_window() -> None:
    clock = Clock(0.0)
    admission = Admission(4, clock=clock)
    reporter = LoadReporter(
        admission, None, cores=1, clock=clock, cpu_clock=Clock(0.0), refresh_s=0.05
    )
    clock.now = 60.0  # a minute with no call: the first report after it spans the minute
    reporter.observe(record())
    assert decoded(reporter).rps_fractional == pytest.approx(1 / 60)
    for step in range(1, 5):  # then 10 calls per second
        clock.now = 60.0 + step / 10
        reporter.observe(record())
        report = decoded(reporter)
    assert report.rps_fractional == pytest.approx(10.0)  # 4 calls in the 0.4 s since 60.0


class FakeContext:
    """What `Reporting` passes on to grpc's context."""

    def __init__(self) -> None:
        self.aborted: tuple[Any, ...] | None = None
        self.trailers: Any = None

    async def abort(self, code: grpc.StatusCode, details: str, trailers: Any) -> None:
        self.aborted = (code, details, trailers)
        raise RuntimeError("aborted")  # grpc raises AbortError

    def set_trailing_metadata(self, trailers: Any) -> None:
        self.trailers = trailers

    async def write(self, message: bytes) -> None: ...
    async def read(self) -> bytes:
        return b""

    async def send_initial_metadata(self, metadata: Any) -> None: ...
    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> Any:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK


class FixedLoad:
    def trailer(self) -> tuple[str, bytes]:
        return (LOAD_TRAILER, b"report")


LOAD = (LOAD_TRAILER, b"report")


def test_an_answer_ends_with_the_relayed_trailers_and_one_report() -> None:
    real = FakeContext()
    context = Reporting(real, FixedLoad())
    context.set_trailing_metadata((("x-worker", "a"), (LOAD_TRAILER, b"the worker's own")))
    assert real.trailers is None  # kept until the call ends
    context.end()
    context.end()
    assert real.trailers == (("x-worker", "a"), LOAD)
    assert context.code() is grpc.StatusCode.OK  # anything else: the context's own


def test_a_call_that_sets_no_trailers_still_carries_the_report() -> None:
    real = FakeContext()
    Reporting(real, FixedLoad()).end()
    assert real.trailers == (LOAD,)


async def test_an_abort_carries_its_trailers_and_the_report_once() -> None:
    real = FakeContext()
    context = Reporting(real, FixedLoad())
    with pytest.raises(RuntimeError):
        await context.abort(grpc.StatusCode.NOT_FOUND, "no", (("x-http-status", "404"),))
    context.end()  # the status went out with the abort: nothing more is set
    assert real.aborted == (grpc.StatusCode.NOT_FOUND, "no", (("x-http-status", "404"), LOAD))
    assert real.trailers is None


async def test_an_abort_without_trailers_sends_those_set_before() -> None:
    real = FakeContext()
    context = Reporting(real, FixedLoad())
    context.set_trailing_metadata((("x-worker", "a"),))
    with pytest.raises(RuntimeError):
        await context.abort(grpc.StatusCode.INTERNAL, "oops")
    assert real.aborted == (grpc.StatusCode.INTERNAL, "oops", (("x-worker", "a"), LOAD))


@pytest.mark.parametrize(
    ("asked", "floor", "expected"),
    [(None, 1.0, 1.0), (Duration(nanos=200_000_000), 1.0, 1.0), (Duration(seconds=3), 1.0, 3.0),
     (Duration(nanos=250_000_000), 0.1, 0.25)],
)  # fmt: skip
def test_a_stream_gets_the_interval_it_asks_for_never_under_the_floor(
    asked: Duration | None, floor: float, expected: float
) -> None:
    request = OrcaLoadReportRequest(report_interval=asked)
    assert interval_s(request, floor) == expected


def test_orca_settings() -> None:
    default = build_config().orca
    assert (default.trailers, default.min_interval_s, default.max_streams) == (True, 1.0, 256)
    off = build_config({"orca": {"trailers": False, "min_interval_s": 0.05}}).orca
    assert off.trailers is False and off.min_interval_s == 0.05
