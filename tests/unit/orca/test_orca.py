"""ORCA load reports: the report's fields from given totals, the reporter's window and
cache, the trailer added once however a call ends, the out-of-band interval, and the
shares of out-of-band streams (per process, connection and principal or peer)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from structlog.testing import capture_logs

from gateway.config import build_config
from gateway.observability.record import CallRecord
from gateway.orca.report import IN_FLIGHT, QUEUE_DEPTH, OrcaReporter, Sample, load_report
from gateway.orca.service import OrcaService, Share, StreamShares, interval_s
from gateway.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from gateway.orca.v3.orca_pb2 import OrcaLoadReportRequest
from gateway.proxy.admission import Admission
from gateway.proxy.reporting import LOAD_TRAILER, OrcaContext


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


def decoded(reporter: OrcaReporter) -> OrcaLoadReport:
    return OrcaLoadReport.FromString(reporter.serialized())


def test_the_reporter_counts_calls_and_failures_over_its_window() -> None:
    clock, cpu = Clock(100.0), Clock(50.0)
    admission = Admission(4, clock=clock)
    reporter = OrcaReporter(admission, None, cores=2, clock=clock, cpu_clock=cpu)
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
    reporter = OrcaReporter(Admission(4, clock=clock), rooms, cores=1, clock=clock)
    assert decoded(reporter).named_metrics[QUEUE_DEPTH] == 6


def test_the_serialized_report_is_kept_for_the_refresh_period() -> None:
    clock = Clock(100.0)
    admission = Admission(4, clock=clock)
    reporter = OrcaReporter(admission, None, cores=1, clock=clock, cpu_clock=Clock(0.0))
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
    reporter = OrcaReporter(
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
    reporter = OrcaReporter(
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
    """What `OrcaContext` passes on to grpc's context."""

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
    real: Any = FakeContext()
    context = OrcaContext(real, FixedLoad())
    context.set_trailing_metadata((("x-worker", "a"), (LOAD_TRAILER, b"the worker's own")))
    assert real.trailers is None  # kept until the call ends
    context.end()
    context.end()
    assert real.trailers == (("x-worker", "a"), LOAD)
    assert context.code() is grpc.StatusCode.OK  # anything else: the context's own


def test_a_call_that_sets_no_trailers_still_carries_the_report() -> None:
    real: Any = FakeContext()
    OrcaContext(real, FixedLoad()).end()
    assert real.trailers == (LOAD,)


async def test_an_abort_carries_its_trailers_and_the_report_once() -> None:
    real: Any = FakeContext()
    context = OrcaContext(real, FixedLoad())
    with pytest.raises(RuntimeError):
        await context.abort(grpc.StatusCode.NOT_FOUND, "no", (("x-http-status", "404"),))
    context.end()  # the status went out with the abort: nothing more is set
    assert real.aborted == (grpc.StatusCode.NOT_FOUND, "no", (("x-http-status", "404"), LOAD))
    assert real.trailers is None


async def test_an_abort_without_trailers_sends_those_set_before() -> None:
    real: Any = FakeContext()
    context = OrcaContext(real, FixedLoad())
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


def test_orca_stream_shares_settings() -> None:
    default = build_config().orca
    assert (default.max_streams_per_connection, default.max_streams_per_peer) == (4, None)
    assert default.peer_share == 64  # a quarter of max_streams
    assert build_config({"orca": {"max_streams": 2}}).orca.peer_share == 1  # at least one
    assert build_config({"orca": {"max_streams_per_peer": 10}}).orca.peer_share == 10


def test_a_stream_counts_against_the_process_its_connection_and_its_owner() -> None:
    shares = StreamShares(total=5, per_connection=2, per_owner=3)
    assert shares.enter("c1", "peer:a") is None
    assert shares.enter("c1", "peer:a") is None
    assert shares.enter("c1", "peer:a") is Share.CONNECTION  # nothing counted for it
    assert shares.enter("c2", "peer:a") is None
    assert shares.enter("c3", "peer:a") is Share.PEER
    assert shares.enter("c3", "key:b") is None
    assert shares.enter("c4", "key:c") is None
    assert shares.enter("c5", "key:d") is Share.GATEWAY
    assert shares.open == 5
    assert (shares.held(connection="c1"), shares.held(owner="peer:a")) == (2, 3)
    for connection, owner in [("c1", "peer:a")] * 2 + [
        ("c2", "peer:a"), ("c3", "key:b"), ("c4", "key:c")
    ]:  # fmt: skip
        shares.leave(connection, owner)
    assert shares.open == 0 and shares.held() == 0  # no count of nobody is kept


class StreamContext:
    """What a StreamCoreMetrics stream uses of grpc's context."""

    def __init__(self, peer: str, principal: str | None = None) -> None:
        self._peer, self.principal = peer, principal
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise RuntimeError("aborted")  # grpc raises AbortError


class Principals:
    """A `Identities`: the principal the context says."""

    def principal(self, context: StreamContext) -> str | None:
        return context.principal


def orca_service(refused: list[str], **settings: Any) -> OrcaService:
    reporter = OrcaReporter(Admission(4), None, cores=1)
    config = build_config({"orca": settings}).orca
    caller: Any = Principals()
    return OrcaService(reporter, config, caller, refused=refused.append)


async def opened(service: OrcaService, context: StreamContext) -> Any:
    """A stream that got its first report (still open), or the context that refused it."""
    stream: Any = service.stream_core_metrics(OrcaLoadReportRequest(), context)
    try:
        await stream.__anext__()
    except RuntimeError:
        return context.aborted
    return stream


async def test_streams_past_a_connections_or_a_callers_share_are_refused_and_say_which() -> None:
    refused: list[str] = []
    service = orca_service(
        refused, max_streams=8, max_streams_per_connection=2, max_streams_per_peer=3
    )
    one = "ipv4:10.0.0.1:1000"
    streams = [await opened(service, StreamContext(one)) for _ in range(2)]
    code, message = await opened(service, StreamContext(one))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "on this connection (orca.max_streams_per_connection: 2)" in message
    streams.append(await opened(service, StreamContext("ipv4:10.0.0.1:1001")))
    code, message = await opened(service, StreamContext("ipv4:10.0.0.1:1002"))  # same address
    assert "for this caller" in message and "orca.max_streams_per_peer: 3" in message
    # Another address, or a principal on the same address, has its own share.
    streams.append(await opened(service, StreamContext("ipv4:10.0.0.2:1000")))
    streams.append(await opened(service, StreamContext("ipv4:10.0.0.1:1003", "key:bob")))
    assert service.streams == 5 and service.shares.held(owner="peer:10.0.0.1") == 3
    assert service.shares.held(owner="key:bob") == 1
    assert refused == ["connection", "peer"]
    for stream in streams:
        await stream.aclose()
    assert service.streams == 0 and service.shares.held() == 0


async def test_the_process_cap_is_refused_as_the_gateways_share() -> None:
    refused: list[str] = []
    service = orca_service(refused, max_streams=1)
    held = await opened(service, StreamContext("ipv4:10.0.0.1:1000"))
    with capture_logs() as logs:
        code, message = await opened(service, StreamContext("ipv4:10.0.0.2:1000"))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "on this gateway process (orca.max_streams: 1)" in message
    assert refused == ["gateway"]
    (line,) = logs
    assert (line["event"], line["share"], line["limit"]) == ("orca_stream_refused", "gateway", 1)
    await held.aclose()
    assert await opened(service, StreamContext("ipv4:10.0.0.2:1000")) is not None
