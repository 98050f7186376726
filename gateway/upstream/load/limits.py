"""Overload: when a worker should take no more requests, from what is known of its load.

`max_inflight` is what Envoy calls a circuit breaker (its `max_requests` per host): a bound
on the gateway's own requests to the worker. (Envoy's outlier detection, ejecting a worker
that keeps failing, is gateway/upstream/signals/outlier.py.)

The gateway's own in-flight count is always current; the worker's GetLoads report is
trusted only while fresh (a failed poll must neither clear an overload nor keep a
stale one forever).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.upstream.worker import Worker


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """Per-model limits for one worker; None means no limit. `max_inflight`: a circuit
    breaker in Envoy's sense; `max_waiting` and `max_token_usage`: bounds on the worker's
    own load report."""

    max_inflight: int | None = None
    max_waiting: int | None = None
    max_token_usage: float | None = None
    # With flow control: a worker whose load report is missing or stale counts as
    # saturated for the load limits (calls wait for a fresh report, not guess).
    stale_saturates: bool = False
    # The worker's own running window (its GetServerInfo) bounds the gateway's calls to
    # it: a decode leg's. A decode's call past its window waits in the engine for a slot
    # while its prefill holds the KV on a lease (vLLM NIXL 30 s) or a bootstrap timeout
    # runs; waiting in the gateway (flow control), or refused WORKERS_OVERLOADED, it
    # holds nothing.
    within_window: bool = False

    @property
    def any(self) -> bool:
        return self.within_window or not (
            self.max_inflight is None and self.max_waiting is None and self.max_token_usage is None
        )


def overload_reason(
    worker: Worker, limits: WorkerLimits, now: float, stale_after_s: float
) -> str | None:
    """Why the worker is overloaded, or None if it may take another request."""
    if limits.max_inflight is not None and worker.inflight >= limits.max_inflight:
        return f"{worker.inflight} in flight (limit {limits.max_inflight})"
    window = worker.window
    if limits.within_window and window is not None and worker.inflight >= window:
        return f"{worker.inflight} in flight (its running window {window})"
    load = worker.load
    if load is None or now - load.at > stale_after_s:
        by_load = limits.max_waiting is not None or limits.max_token_usage is not None
        if limits.stale_saturates and by_load:
            return "no fresh load report"
        return None
    if limits.max_waiting is not None and load.waiting > limits.max_waiting:
        return f"{load.waiting} waiting (limit {limits.max_waiting})"
    if limits.max_token_usage is not None and load.token_usage > limits.max_token_usage:
        return f"KV usage {load.token_usage:.2f} (limit {limits.max_token_usage:.2f})"
    return None
