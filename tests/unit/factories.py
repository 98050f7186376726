"""Builders for what the unit tests construct often: each makes the dependencies that
production code receives from its builder (a worker's circuit breaker), so a test names
only what it is about."""

from __future__ import annotations

from typing import Any

from gateway.config import BreakerConfig, WorkerSpec
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.worker import Worker
from gateway.roles import Role, Runtime


def make_worker(
    spec: WorkerSpec,
    model: str = "m",
    runtime: Runtime = Runtime.SGLANG,
    channel: Any = None,  # most tests never call the worker
    *,
    role: Role = Role.REGULAR,
    pairing: str = "",
    breaker: BreakerConfig | None = None,
) -> Worker:
    """A worker as the fleet registers one, with its own breaker (from `breaker`, the
    default settings unless given)."""
    return Worker(
        spec=spec,
        model=model,
        runtime=runtime,
        channel=channel,
        breaker=CircuitBreaker(breaker if breaker is not None else BreakerConfig()),
        role=role,
        pairing=pairing,
    )
