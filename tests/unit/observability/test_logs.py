"""Log lines: a logged exception keeps its traceback in JSON, and the console never
prints a traceback's local variables; console lines leave out empty fields, JSON lines
keep them; the request line names the peer; `process` is a string; one-off lines
(`say`) are JSON in JSON mode; grpc core's own lines become records, bounded in a flood;
a worker leaving service is a warning, its return info."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import structlog
from structlog.testing import capture_logs

from gateway.config import WorkerSpec, build_config
from gateway.engines import engine_adapters
from gateway.observability import corelog, logs
from gateway.observability.logs import Throttle, configure
from gateway.observability.record import CallRecord
from gateway.placement.policies import build_policy
from gateway.upstream.manager import Fleet
from gateway.upstream.registry import FleetEvent
from tests.support.factories import make_worker


def fail(secret: str) -> None:
    raise ValueError("broken " + secret[:0])


@pytest.fixture(autouse=True)
def _reset() -> object:
    yield None
    structlog.reset_defaults()
    logs.prefer("console")


def test_json_lines_carry_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    configure("json", "info")
    try:
        fail("key-0123")
    except ValueError:
        structlog.get_logger("t").exception("probe_internal_error", worker="h:1")
    (line,) = capsys.readouterr().err.splitlines()
    event = json.loads(line)
    assert event["event"] == "probe_internal_error" and event["worker"] == "h:1"
    assert event["exception"].startswith("Traceback (most recent call last):\n")
    assert event["exception"].endswith("ValueError: broken ")
    assert "exc_info" not in event


def test_console_tracebacks_show_no_locals(capsys: pytest.CaptureFixture[str]) -> None:
    configure("console", "info")
    secret = "key-" + str(2468 * 5)  # not in the source text a traceback quotes
    try:
        fail(secret)
    except ValueError:
        structlog.get_logger("t").exception("probe_internal_error")
    text = capsys.readouterr().err
    assert "ValueError: broken" in text and "in fail" in text
    assert secret not in text


# -- lines that say what happened, not the schema ---------------------------------------


def request_fields() -> dict[str, object]:
    """A refused call's request line: most of its fields have nothing to say."""
    record = CallRecord(rpc="Generate", service="sglang.grpc.scheduler.SglangScheduler")
    record.model, record.code, record.peer = "m", "UNAUTHENTICATED", "ipv4:10.0.0.7:40022"
    return record.log_fields()


def test_console_lines_leave_out_empty_fields(capsys: pytest.CaptureFixture[str]) -> None:
    configure("console", "info")
    structlog.get_logger("t").info("request", **request_fields(), lowered=False, empty={})
    (line,) = capsys.readouterr().err.splitlines()
    assert "None" not in line and "=[]" not in line and "={}" not in line
    assert "worker=" not in line and "rooms=" not in line and "empty=" not in line
    for kept in ("attempts=0", "lowered=False", "code=UNAUTHENTICATED", "peer=ipv4:10.0.0.7:40022"):
        assert kept in line


def test_json_lines_keep_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    configure("json", "info")
    fields = request_fields()
    structlog.get_logger("t").info("request", **fields)
    event = json.loads(capsys.readouterr().err)
    assert set(fields) <= set(event)
    assert event["worker"] is None and event["principal"] is None
    assert event["peer"] == "ipv4:10.0.0.7:40022"


def test_a_peer_grpc_percent_encodes_is_logged_readable() -> None:
    record = CallRecord(rpc="Generate", service="s")
    record.peer = "ipv6:%5B::1%5D:40022"
    assert record.log_fields()["peer"] == "ipv6:[::1]:40022"


def test_the_process_is_a_string_on_every_line(capsys: pytest.CaptureFixture[str]) -> None:
    configure("json", "info", process="3")
    structlog.get_logger("t").info("serving")
    logs.say("cannot listen on 127.0.0.1:1: Address already in use")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["process"] for line in lines] == ["3", "3"]


def test_say_is_one_plain_line_on_the_console_and_one_json_line_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.prefer("console")
    logs.say("config error: bad\nline")
    assert capsys.readouterr().err == "gateway: config error: bad\nline\n"
    logs.prefer("json")  # before configure: `--log-format json` on the command line
    logs.say("config error: bad\nline")
    (line,) = capsys.readouterr().err.splitlines()
    event = json.loads(line)
    assert event["event"] == "config error: bad\\nline" and event["level"] == "error"
    assert event["timestamp"].endswith("Z")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_throttle_lets_a_burst_through_then_its_rate_and_counts_the_rest() -> None:
    clock = Clock()
    throttle = Throttle(rate=10.0, burst=3, clock=clock)
    assert [throttle.take() for _ in range(5)] == [0, 0, 0, None, None]
    clock.now += 0.1  # one token back
    assert [throttle.take(), throttle.take()] == [2, None]
    clock.now += 60  # never more than the burst
    assert [throttle.take() for _ in range(4)] == [1, 0, 0, None]


# -- grpc core's lines ------------------------------------------------------------------

HANDSHAKE = (
    "I1201 14:33:45.662420   22214 ssl_transport_security.cc:2563] Handshake failed with "
    "error SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER"
)
ADD_PORT = (
    "E1201 14:33:05.159882   21392 add_port.cc:83] Failed to add port to server: No address "
    "added out of total 1 resolved for '127.0.0.1:38095' (Error in bind for address "
    "'[::ffff:127.0.0.1]:38095': Address already in use)"
)


def test_grpc_core_lines_become_records_with_their_level_and_source() -> None:
    line = corelog.parse(HANDSHAKE)
    assert line is not None and line.level == logging.INFO
    assert line.event.startswith("Handshake failed with error SSL_ERROR_SSL")
    assert line.fields == {"logger": "grpc", "file": "ssl_transport_security.cc:2563"}
    error = corelog.parse("E1201 14:33:05.1 7 chttp2_server.cc:1] boom")
    assert error is not None and (error.level, error.event) == (logging.ERROR, "boom")
    fatal = corelog.parse("F1201 14:33:05.159882 7 x.cc:12] check failed")
    assert fatal is not None and fatal.level == logging.CRITICAL


def test_a_line_the_gateway_reports_itself_is_kept_at_debug() -> None:
    line = corelog.parse(ADD_PORT)  # the gateway says "cannot listen on ..." and exits 2
    assert line is not None and line.level == logging.DEBUG


def test_other_writers_of_stderr_are_logged_as_warnings() -> None:
    line = corelog.parse("Traceback (most recent call last):")
    assert line is not None and line.level == logging.WARNING
    assert line.fields == {"logger": "stderr"}
    assert corelog.parse("   ") is None


def test_a_flood_of_grpc_lines_is_bounded_and_the_next_line_counts_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure("json", "info", process="0")
    clock = Clock()
    reader = corelog.Reader(-1, logging.INFO, throttled=True, clock=clock)
    for _ in range(corelog.BURST + 30):
        reader.emit(HANDSHAKE)
    reader.emit(ADD_PORT)  # debug: not logged, not counted
    reader.emit("an error line nobody parses")  # warning and above: a band of its own
    clock.now += 1.0
    reader.emit(HANDSHAKE)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [e["logger"] for e in lines] == ["grpc"] * corelog.BURST + ["stderr", "grpc"]
    assert {e["process"] for e in lines} == {"0"}
    assert "suppressed" not in lines[-2] and lines[-1]["suppressed"] == 30
    assert lines[-1]["level"] == "info" and lines[-1]["file"] == "ssl_transport_security.cc:2563"


def test_asked_for_every_line_nothing_is_held_back(capsys: pytest.CaptureFixture[str]) -> None:
    configure("json", "debug")
    reader = corelog.Reader(-1, logging.DEBUG, throttled=False)
    for _ in range(corelog.BURST + 5):
        reader.emit(HANDSHAKE)
    reader.emit(ADD_PORT)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == corelog.BURST + 6 and lines[-1]["level"] == "debug"


# -- what an alert fires on -------------------------------------------------------------


async def test_a_worker_leaving_service_is_a_warning_and_its_return_info() -> None:
    fleet = Fleet(build_config(), engine_adapters(), build_policy)
    worker = make_worker(WorkerSpec(host="10.0.0.5", port=30000))
    fleet.registry.add(worker)
    changes = [
        ("status", "pending", "not_ready", "warning"),  # never came up
        ("status", "not_ready", "ready", "info"),
        ("status", "ready", "not_ready", "warning"),  # left service
        ("status", "ready", "draining", "info"),  # the operator's doing
        ("outlier", "closed", "open", "warning"),  # failing calls took it out
        ("outlier", "open", "half_open", "info"),
        ("outlier", "half_open", "open", "warning"),
        ("outlier", "half_open", "closed", "info"),
    ]
    with capture_logs() as logged:
        for kind, old, new, _ in changes:
            fleet.registry.publish(FleetEvent(kind, worker, old, new, "test"))
    seen = [(e["event"], e["old"], e["new"], e["log_level"]) for e in logged]
    assert seen == [(f"worker_{kind}", old, new, level) for kind, old, new, level in changes]
    await fleet.close()


def test_the_reader_logs_what_the_pipe_carries_and_reports_lines_held_back_after_a_lull(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure("json", "info")
    clock = Clock()
    read_fd, write_fd = os.pipe()
    reader = corelog.Reader(read_fd, logging.INFO, throttled=True, clock=clock)
    thread = threading.Thread(target=reader.run)
    thread.start()
    try:
        os.write(write_fd, ((HANDSHAKE + "\n") * (corelog.BURST + 5)).encode())
        os.write(write_fd, b"a line cut in ")  # the rest follows in another write
        os.write(write_fd, b"two\n")
        lines: list[dict[str, object]] = []
        deadline = time.monotonic() + 10
        while len(lines) < corelog.BURST + 1:
            assert time.monotonic() < deadline, lines
            lines += [json.loads(line) for line in capsys.readouterr().err.splitlines()]
            time.sleep(0.01)
        clock.now += 1.0  # room again: the lull (a second without a line) reports the 5
        while not [e for e in lines if e["event"] == "lines_held_back"]:
            assert time.monotonic() < deadline, lines
            lines += [json.loads(line) for line in capsys.readouterr().err.splitlines()]
            time.sleep(0.01)
    finally:
        os.close(write_fd)
        thread.join(10)
    assert not thread.is_alive()  # every writer gone: the reader ends
    assert [e["event"] for e in lines[corelog.BURST :]] == ["a line cut in two", "lines_held_back"]
    assert (lines[-1]["level"], lines[-1]["suppressed"]) == ("info", 5)
