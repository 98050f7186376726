"""This serving process's load as an ORCA report (`xds.data.orca.v3.OrcaLoadReport`), for
the balancers in front of gateway replicas (Envoy's `client_side_weighted_round_robin`,
gRPC's weighted round robin). They weigh a replica by `rps_fractional / utilization`,
the utilization being `application_utilization` when set, else `cpu_utilization`; so
both must describe the same recent interval, and a busy replica (its calls taking longer,
more of them in flight for the same calls per second) gets a smaller weight.

- `cpu_utilization`: this process's CPU time over the interval, as a fraction of the
  cores it may use (its affinity, capped by a container's quota);
- `application_utilization`: the mean number of calls in flight over the interval (the
  admission count, integrated over time) over the admission capacity
  (`limits.max_inflight_requests`, this process's share of it);
- `rps_fractional`, `eps`: engine calls ended per second over the interval, and those
  that failed (any status but OK and the client's own CANCELLED);
- `named_metrics`: `in_flight` (calls in flight now) and, with flow control,
  `queue_depth` (calls waiting in the model queues now).

The interval is the last second or so: the report compares the running totals now with
those of the newest sample at least `WINDOW_S` old. Samples are taken when a report is
asked for (a call's trailer, an out-of-band stream's tick), at most once per `REFRESH_S`,
and the serialized bytes are kept between: no call builds a protobuf.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.observability.record import CallRecord
from gateway.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from gateway.proxy import LOAD_TRAILER, Admission, WaitingRooms

REFRESH_S = 0.1  # the cached report is at most this old when a call ends
WINDOW_S = 1.0  # rates and utilizations are over about this long
IN_FLIGHT = "in_flight"
QUEUE_DEPTH = "queue_depth"
NOT_FAILED = frozenset({"OK", "CANCELLED"})  # a client that leaves is not an error here
MAX_SAMPLES = 64  # more than a window holds at one sample per REFRESH_S


@dataclass(frozen=True, slots=True)
class Sample:
    """Running totals at one instant; a report is made of the change between two."""

    at: float  # monotonic seconds
    cpu_s: float  # this process's CPU time, user + system
    calls: int  # engine calls ended
    errors: int  # of which failed
    busy: float  # call-seconds in flight (Admission.busy)


def load_report(
    older: Sample,
    newer: Sample,
    *,
    cores: float,
    capacity: int,
    in_flight: int,
    queued: int | None,
) -> OrcaLoadReport:
    """The report for the interval from `older` to `newer` (pure): `cores` the process
    may use, `capacity` its admission limit, the calls `in_flight` now and `queued` in
    flow control's queues now (None: flow control off, the metric is left out)."""
    span = newer.at - older.at
    report = OrcaLoadReport()
    if span > 0:
        report.cpu_utilization = max(0.0, newer.cpu_s - older.cpu_s) / span / cores
        report.application_utilization = max(0.0, newer.busy - older.busy) / span / capacity
        report.rps_fractional = (newer.calls - older.calls) / span
        report.eps = (newer.errors - older.errors) / span
    report.named_metrics[IN_FLIGHT] = in_flight
    if queued is not None:
        report.named_metrics[QUEUE_DEPTH] = queued
    return report


class OrcaReporter:
    """One serving process's load reports: counts the engine calls that end (`observe`,
    beside the metrics) and keeps the serialized report, refreshed at most every
    `refresh_s` (`serialized`, `trailer`)."""

    def __init__(
        self,
        admission: Admission,
        rooms: WaitingRooms | None,
        cores: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        refresh_s: float = REFRESH_S,
        window_s: float = WINDOW_S,
    ) -> None:
        self.calls = 0
        self.errors = 0
        self._admission = admission
        self._rooms = rooms
        self._cores = cores
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._refresh_s = refresh_s
        self._window_s = window_s
        self._samples: deque[Sample] = deque([self._sample()], maxlen=MAX_SAMPLES)
        self._due = -math.inf  # when the cached report is stale
        self._trailer: tuple[str, bytes] = (LOAD_TRAILER, b"")

    def observe(self, record: CallRecord) -> None:
        """One engine call ended (the front's observer, after the metrics)."""
        self.calls += 1
        if record.code not in NOT_FAILED:
            self.errors += 1

    def _sample(self) -> Sample:
        return Sample(
            self._clock(), self._cpu_clock(), self.calls, self.errors, self._admission.busy()
        )

    def report(self) -> OrcaLoadReport:
        """A report now, over the last window (takes a sample: `serialized` rations it)."""
        newer = self._sample()
        samples = self._samples
        samples.append(newer)
        # The oldest kept is the newest at least a window old: the report spans a window.
        while len(samples) > 2 and newer.at - samples[1].at >= self._window_s:
            samples.popleft()
        # Nobody asked for a report for over a window (no call ended, no stream open): the
        # sample from before that gap served the first report after it, and goes, so the
        # gap is not averaged into every report of the next window.
        if len(samples) > 2 and samples[1].at - samples[0].at > self._window_s:
            samples.popleft()
        rooms = self._rooms
        queued = sum(rooms.depth().values()) if rooms is not None else None
        return load_report(
            samples[0],
            newer,
            cores=self._cores,
            capacity=self._admission.limit,
            in_flight=self._admission.active,
            queued=queued,
        )

    def serialized(self) -> bytes:
        """The current report's bytes, made again at most every `refresh_s`."""
        now = self._clock()
        if now >= self._due:
            self._due = now + self._refresh_s
            self._trailer = (LOAD_TRAILER, self.report().SerializeToString())
        return self._trailer[1]

    def trailer(self) -> tuple[str, bytes]:
        """`endpoint-load-metrics-bin` and the current report (proxy.reporting)."""
        self.serialized()
        return self._trailer
