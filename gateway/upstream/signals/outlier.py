"""Outlier detection per worker: passive health from the outcomes of real requests.

Envoy's consecutive-failure outlier detection, with a half-open trial: closed, requests
flow; N consecutive failures eject the worker (open): no requests until the cool-down has
passed; then half-open admits exactly one trial request at a time. M consecutive trial
successes close it; a trial failure ejects it again. (What Envoy calls circuit breakers,
limits on requests per host, are gateway/upstream/load/limits.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum, StrEnum

import grpc

from gateway.config import OutlierDetectionConfig


class OutlierState(StrEnum):
    """Closed: in service; open: ejected; half-open: one trial request at a time."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    IGNORED = "ignored"  # says nothing about the worker (the client cancelled)


# What a worker's own trouble looks like; client errors (INVALID_ARGUMENT, NOT_FOUND, ...)
# prove the worker answered, so they count as successes.
FAILURE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
    }
)


def outcome_of(code: grpc.StatusCode) -> Outcome:
    if code is grpc.StatusCode.CANCELLED:
        return Outcome.IGNORED
    return Outcome.FAILURE if code in FAILURE_CODES else Outcome.SUCCESS


Changed = Callable[[OutlierState, OutlierState, str], None]  # (old, new, cause)


class OutlierDetector:
    """One worker's ejection state, fed the outcomes of the requests placed on it. Its
    changes go to `on_change` (Envoy's detector is the model: it owns its timer), the end
    of a cool-down included, which no request tells: the detector's own timer does."""

    def __init__(self, settings: OutlierDetectionConfig) -> None:
        self.settings = settings
        self.state = OutlierState.CLOSED
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.trial_in_flight = False
        self._on_change: Changed | None = None
        self._cooldown: asyncio.TimerHandle | None = None

    def watch(self, on_change: Changed) -> None:
        """`on_change(old, new, cause)` from now on, as the state changes."""
        self._on_change = on_change

    def close(self) -> None:
        """The worker is gone: no cool-down ends for it any more."""
        self._on_change = None
        if self._cooldown is not None:
            self._cooldown.cancel()
            self._cooldown = None

    def _changed(self, old: OutlierState, cause: str) -> None:
        if self._on_change is None:
            return
        self._on_change(old, self.state, cause)
        if self.state is OutlierState.OPEN:
            if self._cooldown is not None:
                self._cooldown.cancel()
            loop = asyncio.get_running_loop()
            self._cooldown = loop.call_later(self.settings.cooldown_s, self._cooled)

    def _cooled(self) -> None:
        self._cooldown = None
        if self._on_change is not None and self.state is OutlierState.OPEN:
            self._on_change(self.state, self.state, "cool-down over")

    def admits(self, now: float) -> bool:
        """Whether a new request may go to this worker now (no side effect)."""
        if self.state is OutlierState.CLOSED:
            return True
        if self.trial_in_flight:
            return False
        return self.state is OutlierState.HALF_OPEN or (
            now - self.opened_at >= self.settings.cooldown_s
        )

    def on_dispatch(self, now: float) -> bool:
        """A request was placed here; returns True if the state changed."""
        if self.state is OutlierState.CLOSED:
            return False
        changed = self.state is OutlierState.OPEN
        if changed:
            self.state, self.successes = OutlierState.HALF_OPEN, 0
            self._changed(OutlierState.OPEN, "cool-down over: trial request")
        self.trial_in_flight = True
        return changed

    def record(self, outcome: Outcome, now: float, *, trial: bool) -> bool:
        """One request's outcome; `trial` says whether it was the half-open trial.

        Returns True if the state changed.
        """
        old = self.state
        if self._judge(outcome, now, trial=trial):
            self._changed(old, outcome.value)
            return True
        return False

    def _judge(self, outcome: Outcome, now: float, *, trial: bool) -> bool:
        if self.state is OutlierState.CLOSED:
            if outcome is Outcome.FAILURE:
                self.failures += 1
                if self.failures >= self.settings.failure_threshold:
                    return self._open(now)
            elif outcome is Outcome.SUCCESS:
                self.failures = 0
            return False
        if not trial:
            return False  # requests placed before the ejection say nothing new
        self.trial_in_flight = False
        if self.state is OutlierState.HALF_OPEN:
            if outcome is Outcome.FAILURE:
                return self._open(now)
            if outcome is Outcome.SUCCESS:
                self.successes += 1
                if self.successes >= self.settings.success_threshold:
                    self.state, self.failures = OutlierState.CLOSED, 0
                    return True
        return False

    def _open(self, now: float) -> bool:
        self.state, self.opened_at = OutlierState.OPEN, now
        self.failures = self.successes = 0
        self.trial_in_flight = False
        return True
