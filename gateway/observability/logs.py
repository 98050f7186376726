"""structlog set-up: console lines for people, JSON lines for machines, all on stderr.

Control characters in logged strings (client-supplied names, headers, error texts) are
escaped before rendering, so no value can end a line, forge one, or drive a terminal."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

import structlog

from gateway.core.bucket import TokenBucket

# C0 and C1 controls (newline and tab too), DEL, the Unicode line and paragraph separators,
# and the bidirectional overrides and isolates (text that reads other than it is).
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
MAX_DEPTH = 4  # nested lists and mappings looked into


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    short = _SHORT.get(char)
    if short is not None:
        return short
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """`text` with its control characters written as escapes (`\\x00`, `\\n`,
    `\\u2028`); the same object when it has none (checked at C speed: every control
    character is also unprintable)."""
    if text.isprintable():
        return text
    return CONTROL.sub(_escape, text)


def _clean(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return escape(value)
    if depth >= MAX_DEPTH:
        return value
    if isinstance(value, list | tuple):
        cleaned = [_clean(item, depth + 1) for item in value]
        if all(a is b for a, b in zip(cleaned, value, strict=True)):
            return value
        return cleaned if isinstance(value, list) else tuple(cleaned)
    if isinstance(value, dict):
        changed = {k: c for k, v in value.items() if (c := _clean(v, depth + 1)) is not v}
        return {**value, **changed} if changed else value
    return value


def escape_controls(
    _: object, __: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    """structlog processor: every string value (in lists and mappings too) escaped."""
    for key, value in event.items():
        if not (type(value) is str and value.isprintable()):  # the usual case, inline
            cleaned = _clean(value)
            if cleaned is not value:
                event[key] = cleaned
    return event


def drop_empty(_: object, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    """structlog processor (console only): fields with nothing to say (None, "", an empty
    list, tuple or mapping) left out, so a line shows what happened, not the schema. 0
    and False are kept: they say something."""
    for key in [k for k, v in event.items() if v is None or (type(v) in _SIZED and not v)]:
        if key != "event":
            del event[key]
    return event


_SIZED = (str, list, tuple, dict)


class Throttle:
    """A token bucket for log lines that a client or a flood can cause: at most `rate`
    lines a second after a burst of `burst`. `take` says whether a line may go out and,
    if so, how many were held back since the last one went (for the line to say so)."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        self._bucket = TokenBucket(rate, burst, clock())
        self.suppressed = 0

    def take(self) -> int | None:
        """None: hold the line back (counted); else the lines held back before it."""
        bucket = self._bucket
        bucket.fill(self.clock())
        if bucket.wait_s(1) > 0:
            self.suppressed += 1
            return None
        bucket.take(1)
        held, self.suppressed = self.suppressed, 0
        return held


@dataclass(slots=True)
class _Output:
    """Where the gateway's own lines go, in which format, and with which `process`:
    `say` writes one-off lines (a port that cannot be bound) the way `configure` set up."""

    json: bool = False
    configured: bool = False  # by `configure`: JSON lines are then structlog's own
    process: str | None = None
    stream: TextIO | None = None  # None: sys.stderr, looked up when written


_output = _Output()


def prefer(log_format: str) -> None:
    """The format of `say`'s lines before `configure` runs (a config error, with
    `--log-format json` on the command line, is a JSON line too)."""
    _output.json, _output.configured = log_format == "json", False


def say(text: str) -> None:
    """One line for a person or a log pipeline, written at once (the serving processes of
    `--processes N` share stderr): `gateway: TEXT` on the console, else a JSON error
    line with the same fields as every other."""
    if _output.json and _output.configured:  # the same writer (and lock) as every line
        structlog.get_logger("gateway").error(text)
        return
    stream = _output.stream if _output.stream is not None else sys.stderr
    if not _output.json:
        stream.write(f"gateway: {text}\n")
        stream.flush()
        return
    event: dict[str, object] = {"event": escape(text), "level": "error"}
    if _output.process is not None:
        event["process"] = _output.process
    event["timestamp"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    stream.write(json.dumps(event) + "\n")
    stream.flush()


def configure(
    log_format: str, level: str, process: str | None = None, stream: TextIO | None = None
) -> None:
    """`process`: the serving process's index, or "supervisor" (`--processes N`), on every
    line the process logs. `stream`: where lines go (sys.stderr unless given: a process
    whose stderr carries grpc core's lines writes its own to the real one, see
    gateway.observability.corelog)."""
    # Tracebacks (log.exception): one "exception" string field in JSON; plain text on the
    # console, never the local variables (which may hold keys or request bytes).
    json_lines = log_format == "json"
    _output.json, _output.process, _output.stream = json_lines, process, stream
    _output.configured = True
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
    )
    structlog.configure(
        processors=[
            *([_process_field(process)] if process is not None else []),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            escape_controls,
            # After the escaping: JSON escapes the traceback's newlines itself. JSON
            # lines keep every field (a stable schema); console lines drop empty ones.
            *([structlog.processors.format_exc_info] if json_lines else [drop_empty]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write per line (message and newline together): the serving processes of
        # `--processes N` share one stderr, and print() would write the newline apart.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr if stream is None else stream),
        cache_logger_on_first_use=True,
    )


def _process_field(index: str) -> structlog.types.Processor:
    def add(_: object, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
        event.setdefault("process", index)
        return event

    return add
