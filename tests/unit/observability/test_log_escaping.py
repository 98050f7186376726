"""Control characters escaped in logs (gateway.observability.logs): in a value, in nested
values (clean ones kept as they are), and in the rendered console and JSON lines."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog

from gateway.observability.logs import escape, escape_controls

# -- logs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain", "plain"),
        ("café ü 模型", "café ü 模型"),
        ("a\x00b", "a\\x00b"),
        ("line\nforged=1", "line\\nforged=1"),
        ("\t\r\x1b[31m\x7f", "\\t\\r\\x1b[31m\\x7f"),
        ("\x85\u2028\u202e", "\\x85\\u2028\\u202e"),
    ],
)
def test_control_characters_are_escaped(raw: str, shown: str) -> None:
    assert escape(raw) == shown


def test_the_processor_escapes_nested_values_and_keeps_clean_ones_as_they_are() -> None:
    clean = ["a", ("b", 1)]
    event = {
        "event": "request",
        "model": "m\x00",
        "ids": ["ok", "x\ny"],
        "meta": {"k": "v\x1b"},
        "n": 3,
        "clean": clean,
    }
    out = escape_controls(None, "info", event)
    assert out["model"] == "m\\x00" and out["ids"] == ["ok", "x\\ny"]
    assert out["meta"] == {"k": "v\\x1b"} and out["n"] == 3 and out["clean"] is clean


@pytest.fixture
def rendered() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_rendered_lines_carry_no_control_characters(
    log_format: str, rendered: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.observability import logs

    logs.configure(log_format, "info")
    structlog.get_logger("t").info("request", model="evil\x00\nforged=1\x1b[2J")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x00" not in err and "\x1b" not in err
    if log_format == "json":
        assert json.loads(err)["model"] == "evil\\x00\\nforged=1\\x1b[2J"
    else:  # quoted with repr() or not, as ConsoleRenderer sees fit: escaped either way
        assert "evil\\x00" in err or "evil\\\\x00" in err
