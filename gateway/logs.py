"""structlog set-up: console lines for people, JSON lines for machines, all on stderr.

Control characters in logged strings (client-supplied names, headers, error texts) are
escaped before rendering, so no value can end a line, forge one, or drive a terminal."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import structlog

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


def configure(log_format: str, level: str, process: int | str | None = None) -> None:
    """`process`: the serving process's index, or "supervisor" (`--processes N`), on every
    line the process logs."""
    # Tracebacks (log.exception): one "exception" string field in JSON; plain text on the
    # console, never the local variables (which may hold keys or request bytes).
    json = log_format == "json"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json
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
            # After the escaping: JSON escapes the traceback's newlines itself.
            *([structlog.processors.format_exc_info] if json else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write per line (message and newline together): the serving processes of
        # `--processes N` share one stderr, and print() would write the newline apart.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _process_field(index: int | str) -> structlog.types.Processor:
    def add(_: object, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
        event.setdefault("process", index)
        return event

    return add
