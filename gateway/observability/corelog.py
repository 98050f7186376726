"""grpc core's own lines (and anything else written to file descriptor 2) routed through
the gateway's logger, so that stderr carries nothing but the gateway's lines: JSON lines
a log pipeline can parse, with `--log-format json`.

grpc core (C++, absl logging) writes straight to fd 2, where no Python logger sees it:
`E1201 14:33:05.159882 21392 add_port.cc:83] Failed to add port to server: ...`, `I1201
... ssl_transport_security.cc:2563] Handshake failed ...`. So a gateway process, as it
starts, points fd 2 at a pipe and keeps the real stderr for its own lines; a reader
thread turns each line that arrives on the pipe into a log record (logger `grpc`, the
level from the line's first letter, `file` the source file and line), rendered like
every other line. Anything else written to fd 2 (a Python warning, a traceback the
interpreter prints) comes out the same way, with logger `stderr` at warning.

Why not GRPC_VERBOSITY=ERROR (silencing grpc below error): the error lines would still
not be JSON, and an operator who asks grpc for more (GRPC_VERBOSITY, GRPC_TRACE) would
get unparseable lines again. The pipe catches every writer of fd 2 whenever it writes,
needs no hook into grpc, and leaves grpc's verbosity to the operator.

- Lines the gateway reports itself are kept at debug, so an error is not printed twice:
  grpc's `add_port.cc` line for a port it cannot bind (the gateway says `cannot listen on
  ...` and exits 2).
- A flood (a client failing TLS handshakes in a loop) is bounded: at most RATE lines a
  second (after a burst of BURST) at info and below, and as many at warning and above;
  the next line that goes out says how many were held back (`suppressed`), and a lull
  of a second reports them too. Not bounded when GRPC_TRACE is set or the log level is
  debug: someone asked for every line.
- The pipe is drained when the process exits normally. A process that dies outright
  (SIGKILL, a fatal signal) may take the lines still in the pipe with it; faulthandler's
  traceback (PYTHONFAULTHANDLER) goes to the real stderr directly.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import fcntl
import logging
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import structlog

from gateway.observability.logs import Throttle, configure

# absl's prefix: severity letter, MMDD, time, thread id, file:line, "] ".
GRPC_LINE = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([^\s:\]]+:\d+)\] ?(.*)")
LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Source files whose lines the gateway reports in its own words.
REPORTED = frozenset({"add_port.cc"})
RATE = 10.0  # lines a second, per band (info and below; warning and above)
BURST = 20
LULL_S = 1.0  # held-back counts are reported after this long without a line
MAX_LINE = 16 * 1024  # bytes: a longer line is cut into records of this size
PIPE_SIZE = 1 << 20  # room for a burst while the reader waits for the GIL (Linux)
EXIT_DRAIN_S = 1.0


@dataclass(frozen=True, slots=True)
class Line:
    """One line written to fd 2, as a log record."""

    level: int
    event: str
    fields: dict[str, str] = field(default_factory=dict)


def parse(text: str) -> Line | None:
    """The record for one line written to fd 2 (no newline); None for a blank one."""
    if not text.strip():
        return None
    match = GRPC_LINE.match(text)
    if match is None:
        return Line(logging.WARNING, text, {"logger": "stderr"})
    letter, where, message = match.groups()
    level = logging.DEBUG if where.partition(":")[0] in REPORTED else LEVELS[letter]
    return Line(level, message, {"logger": "grpc", "file": where})


class Reader:
    """Reads the pipe behind fd 2 and logs each line (see the module's docstring)."""

    def __init__(
        self,
        read_fd: int,
        level: int,
        throttled: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fd = read_fd
        self._level = level
        bands = (Throttle(RATE, BURST, clock), Throttle(RATE, BURST, clock))
        self._bands = bands if throttled else None
        self._log = structlog.get_logger("grpc")

    def run(self) -> None:
        """Until every writer of the pipe has closed it (the process's exit)."""
        pending = b""
        while True:
            # Woken after a lull only while some lines are held back: idle, it sleeps.
            held = self._bands is not None and any(band.suppressed for band in self._bands)
            readable, _, _ = select.select([self._fd], [], [], LULL_S if held else None)
            if not readable:
                self._report_held()
                continue
            chunk = os.read(self._fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            while len(pending) > MAX_LINE:
                lines.append(pending[:MAX_LINE])
                pending = pending[MAX_LINE:]
            for raw in lines:
                self.emit(raw.decode(errors="replace").rstrip("\r"))
        if pending:
            self.emit(pending.decode(errors="replace"))
        self._report_held()

    def emit(self, text: str) -> None:
        """Log one line (if its level is logged and its band has room)."""
        line = parse(text)
        if line is None or line.level < self._level:
            return
        fields: dict[str, object] = dict(line.fields)
        if self._bands is not None:
            held = self._band(line.level).take()
            if held is None:
                return
            if held:
                fields["suppressed"] = held
        self._write(line.level, line.event, fields)

    def _band(self, level: int) -> Throttle:
        assert self._bands is not None
        return self._bands[level >= logging.WARNING]

    def _report_held(self) -> None:
        for level, band in zip((logging.INFO, logging.WARNING), self._bands or (), strict=False):
            if band.suppressed and (held := band.take()):
                self._write(level, "lines_held_back", {"logger": "grpc", "suppressed": held})

    def _write(self, level: int, event: str, fields: dict[str, object]) -> None:
        # The reader must go on whatever happens to one line: fd 2's writers (grpc's
        # threads) block once the pipe is full.
        with contextlib.suppress(Exception):
            self._log.log(level, event, **fields)


@dataclass(slots=True)
class _Routed:
    real_fd: int  # the process's real stderr, kept for its own lines and its children
    stream: TextIO
    thread: threading.Thread | None = None


_routed: _Routed | None = None


def real_stderr() -> int | None:
    """The real stderr's descriptor when fd 2 is routed: what a process this one starts
    should write to (the serving processes log on their own, not through this pipe)."""
    return _routed.real_fd if _routed is not None else None


def install(log_format: str, level: str, process: str | None = None) -> None:
    """Configure the logs (gateway.observability.logs.configure) with fd 2 routed through them: call
    once, first thing in a gateway process, before it listens."""
    global _routed
    if _routed is not None:
        configure(log_format, level, process, _routed.stream)
        return
    real_fd = os.dup(2)  # not inherited by processes this one starts, unless passed
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(OSError, AttributeError):  # Linux only; a default pipe works
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    stream = open(  # noqa: SIM115 - the process's stderr, open for its life
        real_fd, "w", buffering=1, encoding=encoding, errors="backslashreplace", closefd=False
    )
    configure(log_format, level, process, stream)
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    if faulthandler.is_enabled():  # a fatal error's traceback: straight out, not queued
        faulthandler.enable(file=stream)
    routed = _routed = _Routed(real_fd, stream)
    threshold = logging.getLevelNamesMapping()[level.upper()]
    throttled = threshold > logging.DEBUG and not os.environ.get("GRPC_TRACE")
    reader = Reader(read_fd, threshold, throttled)
    routed.thread = threading.Thread(target=_read, args=(reader, read_fd), daemon=True)
    routed.thread.name = "gateway-stderr"
    routed.thread.start()
    atexit.register(_drain)


def _read(reader: Reader, read_fd: int) -> None:
    try:
        reader.run()
    finally:
        # Whatever ended the reader, fd 2 must not stay a pipe nobody reads.
        if _routed is not None:
            with contextlib.suppress(OSError):
                os.dup2(_routed.real_fd, 2)
        os.close(read_fd)


def _drain() -> None:
    """At exit: fd 2 back to the real stderr (the pipe's last writer gone), then wait
    (bounded) for the reader to log what was still in the pipe."""
    routed = _routed
    if routed is None or routed.thread is None:
        return
    with contextlib.suppress(OSError):
        sys.stderr.flush()
        os.dup2(routed.real_fd, 2)
    routed.thread.join(EXIT_DRAIN_S)
