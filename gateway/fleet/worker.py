"""A worker as the gateway sees it: identity, and the live signals that decide its status."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from grpc import aio

from gateway.config import BreakerConfig, WorkerSpec
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.probe import ProbeState
from gateway.roles import Role, Runtime


class WorkerStatus(StrEnum):
    """`pending` until its first probe; only `ready` workers are routable."""

    PENDING = "pending"
    READY = "ready"
    NOT_READY = "not_ready"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's own view of its load, from GetLoads (summed or maxed over DP ranks).

    Worker numbers are untrusted: `checked` keeps request counts within
    0..MAX_REQUESTS and usage within 0..1 (finite), a figure outside them keeping the
    previous report's; `rejected` counts the figures so ignored, over the worker's life.
    """

    MAX_REQUESTS: ClassVar[int] = 1_000_000  # more than any engine queues: a bogus figure

    running: int
    waiting: int
    token_usage: float
    at: float  # monotonic time of the poll that produced it
    own: int = 0  # the gateway's own requests in flight on the worker at that time
    rejected: int = 0  # figures of this worker's reports ignored so far

    def others(self) -> int:
        """Requests the report shows beyond the gateway's own (other clients' load):
        what the gateway's in-flight count cannot know, carried forward until the next
        report, while its own count stays exact."""
        return max(0, self.running + self.waiting - self.own)

    @classmethod
    def count_ok(cls, value: int) -> bool:
        return 0 <= value <= cls.MAX_REQUESTS

    @staticmethod
    def usage_ok(value: float) -> bool:
        return math.isfinite(value) and 0.0 <= value <= 1.0

    @classmethod
    def checked(
        cls,
        running: int,
        waiting: int,
        token_usage: float,
        at: float,
        own: int,
        previous: LoadReport | None,
    ) -> LoadReport:
        """A report from a worker's figures: each one out of range (NaN, infinite,
        negative, overflowing) is ignored, the previous report's (or 0) kept instead."""
        bad = 0
        if cls.count_ok(running):
            run = running
        else:
            run, bad = (previous.running if previous else 0), bad + 1
        if cls.count_ok(waiting):
            wait = waiting
        else:
            wait, bad = (previous.waiting if previous else 0), bad + 1
        if cls.usage_ok(token_usage):
            usage = token_usage
        else:
            usage, bad = (previous.token_usage if previous else 0.0), bad + 1
        rejected = (previous.rejected if previous else 0) + bad
        return cls(run, wait, usage, at, own, rejected)


def derive_status(draining: bool, connected: bool, healthy: bool | None) -> WorkerStatus:
    """The status follows from the signals; nothing else sets it."""
    if draining:
        return WorkerStatus.DRAINING
    if healthy is None:
        return WorkerStatus.PENDING
    return WorkerStatus.READY if healthy and connected else WorkerStatus.NOT_READY


@dataclass(eq=False, slots=True)
class Worker:
    """One registered worker. Identity is its address; everything else is live state."""

    spec: WorkerSpec
    model: str
    runtime: Runtime
    channel: aio.Channel
    role: Role = Role.REGULAR
    bootstrap_port: int | None = None  # prefill: its rendezvous port (SGLang PD)
    pairing: str = ""  # prefill and decode pair only with equal keys (same KV transfer setup)
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(BreakerConfig()))
    status: WorkerStatus = WorkerStatus.PENDING
    status_cause: str = "not yet probed"
    connected: bool = False
    draining: bool = False
    probe: ProbeState = field(default_factory=ProbeState)
    load: LoadReport | None = None
    load_error: str | None = None
    inflight: int = 0
    idle: asyncio.Event | None = None  # set when in-flight reaches zero, while draining

    @property
    def id(self) -> str:
        return self.spec.address

    @property
    def bootstrap_host(self) -> str:
        return self.spec.bootstrap_host or self.spec.host

    def release(self) -> None:
        """One request finished on this worker."""
        self.inflight -= 1
        if self.inflight == 0 and self.idle is not None:
            self.idle.set()

    def available(self, now: float) -> bool:
        """Routable: ready, and the circuit breaker admits a request."""
        return self.status is WorkerStatus.READY and self.breaker.admits(now)

    def __repr__(self) -> str:
        return f"Worker({self.id} {self.runtime}/{self.model}/{self.role} {self.status})"
