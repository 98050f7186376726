"""structlog set-up: console lines for people, JSON lines for machines, all on stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(log_format: str, level: str, process: int | str | None = None) -> None:
    """`process`: the serving process's index, or "supervisor" (`--processes N`), on every
    line the process logs."""
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            *([_process_field(process)] if process is not None else []),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
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
