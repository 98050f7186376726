"""Log lines: a logged exception keeps its traceback in JSON, and the console never
prints a traceback's local variables."""

from __future__ import annotations

import json

import pytest
import structlog

from gateway.logs import configure


def fail(secret: str) -> None:
    raise ValueError("broken " + secret[:0])


@pytest.fixture(autouse=True)
def _reset() -> object:
    yield None
    structlog.reset_defaults()


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
