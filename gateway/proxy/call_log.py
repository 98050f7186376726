"""`CallLog`: how a door tells of its calls as they end (metrics, traces, request lines)."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from gateway.observability.logs import Throttle
from gateway.observability.record import CallRecord
from gateway.proxy.call import Call

requests = structlog.get_logger("gateway.request")
# Request lines of calls refused UNAUTHENTICATED, per process: 10 a second after a burst
# of 20; the next line says how many were held back (every refusal is counted in
# gateway_auth_failures_total, and gateway.security.auth logs them by address).
REFUSED_LINES = Throttle(10.0, 20)


class CallLog:
    """How a door tells of its calls as they end: observed (metrics, load reports), the
    trace finished, and a request line at the info level, those of calls refused
    UNAUTHENTICATED at a bounded rate (a client may send them at any rate). A call
    handed whole to the relay is the relay's to tell of."""

    __slots__ = ("_lines", "observe")

    def __init__(self, observe: Callable[[CallRecord], None], log_level: str) -> None:
        self.observe = observe
        self._lines = log_level in ("debug", "info")

    def ended(self, call: Call) -> None:
        if call.handed:
            return
        record, trace = call.record, call.trace
        if trace is not None:
            trace.finish(record)
        self.observe(record)
        if not self._lines:  # below the log level: its fields are not even built
            return
        if record.code == "UNAUTHENTICATED" and not call.logged(REFUSED_LINES):
            return
        requests.info("request", **record.log_fields())
