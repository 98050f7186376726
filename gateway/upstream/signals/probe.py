"""Active health: the probe result vocabulary and the pure threshold logic.

A worker that answers NOT_SERVING is believed at once; a probe that times out or errors
counts towards the failure threshold (a missed probe may be a hiccup); a probe that
failed inside the gateway (a bug: INTERNAL) says nothing about the worker and changes
nothing but the last result shown. Recovery needs
`success_threshold` consecutive good probes; the very first good probe of a new worker
is enough, so a fleet comes up at the speed of one probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gateway.config import ProbeConfig


class ProbeKind(Enum):
    SERVING = "serving"
    NOT_SERVING = "not_serving"  # the worker said so: authoritative
    ERROR = "error"  # timeout, connection error, unexpected status: counts to threshold
    INTERNAL = "internal"  # the probe itself failed (a gateway bug): no verdict


@dataclass(frozen=True, slots=True)
class ProbeResult:
    kind: ProbeKind
    detail: str
    at: float = 0.0  # when it was taken (wall clock, for the admin API); 0: not said


@dataclass(slots=True)
class ProbeState:
    healthy: bool | None = None  # None: never probed successfully nor failed for sure
    successes: int = 0
    failures: int = 0
    last: ProbeResult | None = None
    last_at: float = 0.0

    def reset_for_reconnect(self) -> None:
        """After a lost connection the worker must prove itself again."""
        if self.healthy:
            self.healthy = False
        self.successes = 0


def judge(state: ProbeState, result: ProbeResult, settings: ProbeConfig) -> bool | None:
    """Fold one probe result into the state; returns the new `healthy` value."""
    state.last = result
    if result.at:
        state.last_at = result.at
    if result.kind is ProbeKind.INTERNAL:
        return state.healthy  # the gateway's failure, not the worker's: nothing counted
    if result.kind is ProbeKind.SERVING:
        state.successes += 1
        state.failures = 0
        if state.healthy is None or state.successes >= settings.success_threshold:
            state.healthy = True
    elif result.kind is ProbeKind.NOT_SERVING:
        state.successes = 0
        state.failures += 1
        state.healthy = False
    else:
        state.successes = 0
        state.failures += 1
        if state.failures >= settings.failure_threshold:
            state.healthy = False
    return state.healthy
