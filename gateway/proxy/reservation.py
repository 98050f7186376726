"""Reservations: one request's slot on a worker, taken at placement, released once.

A slot is taken before any call starts on it (with no await between placing and
reserving, the worker's in-flight count goes up and, if its outlier detection is
half-open, the call becomes the one trial), and is released exactly once, with the
call's outcome (or none, if unused or cancelled by the client). `Upstreams` takes them;
each `UpstreamCall` releases its own, and a placement its unused ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import grpc
import structlog

from gateway.placement.decision import Decision
from gateway.upstream.signals.outlier import Outcome, outcome_of
from gateway.upstream.worker import Worker

log = structlog.get_logger("gateway.upstream")


class Outcomes(Protocol):
    """Where upstream calls report what happened on a worker (the fleet's passive health),
    and that a reservation on it ended."""

    def released(self, worker: Worker) -> None: ...

    def on_dispatch(self, worker: Worker) -> bool: ...

    def record_outcome(self, worker: Worker, outcome: Outcome, *, trial: bool) -> None: ...


class Reservation:
    """One request's slot on a worker, taken when it was placed there."""

    __slots__ = ("_judge", "_outcomes", "released", "trial", "worker")

    def __init__(self, worker: Worker, outcomes: Outcomes, *, judge: bool) -> None:
        self.worker = worker
        self._outcomes = outcomes
        self._judge = judge  # False for calls that say nothing about the worker (Abort)
        worker.reserve()
        self.trial = outcomes.on_dispatch(worker) if judge else False
        self.released = False

    def release(self, code: grpc.StatusCode | None) -> None:
        """Give the slot back; `code` None: unused, or ended by the client (no verdict)."""
        if self.released:
            return
        self.released = True
        self.worker.release()
        self._outcomes.released(self.worker)
        if self._judge:
            outcome = Outcome.IGNORED if code is None else outcome_of(code)
            try:
                self._outcomes.record_outcome(self.worker, outcome, trial=self.trial)
            except Exception:  # the fleet's trouble must not become the request's
                log.exception("record_outcome_failed", worker=self.worker.id)


@dataclass(slots=True)
class ReservedPlacement:
    """A placement with a reservation on each worker it picked."""

    decision: Decision
    slots: dict[Worker, Reservation] = field(default_factory=dict)

    def take(self, worker: Worker) -> Reservation:
        return self.slots.pop(worker)

    def release_unused(self) -> None:
        for reservation in self.slots.values():
            reservation.release(None)
        self.slots.clear()
