"""What the calls a worker answered looked like to the clients: answers by gRPC code, and
time to first message and between messages as histograms. Kept on the worker itself, so a
dashboard's per-worker series come and go with the worker (bounded by the fleet, as
discovery's `max_hosts` bounds it) and cost a few additions per call."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Buckets:
    """A histogram's cumulative-to-be counts: observation i falls in the first bucket
    whose bound is at least it (the last, +Inf, takes the rest)."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        """`(le, count)` pairs as Prometheus shows them, +Inf last."""
        running, shown = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            shown.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(running)))
        return shown


# A prediction's error relative to what was observed: within 5% is very good, past 1
# (off by more than the time itself) is no prediction.
ERROR_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(slots=True)
class CallStats:
    """One worker's answered calls (written by the metrics' call observer only)."""

    first_bounds: Sequence[float]
    gap_bounds: Sequence[float]
    codes: dict[str, int] = field(default_factory=dict)
    first: Buckets = field(init=False)
    gaps: Buckets = field(init=False)
    errors: Buckets = field(init=False)  # |predicted - observed| / observed first message

    def __post_init__(self) -> None:
        self.first = Buckets(self.first_bounds)
        self.gaps = Buckets(self.gap_bounds)
        self.errors = Buckets(ERROR_BOUNDS)

    def answered(self, code: str, first_message_s: float | None, gap_s: float | None) -> None:
        self.codes[code] = self.codes.get(code, 0) + 1
        if first_message_s is not None:
            self.first.observe(first_message_s)
        if gap_s is not None:
            self.gaps.observe(gap_s)

    def predicted(self, predicted_s: float, observed_s: float) -> None:
        """A first message's predicted time beside the observed one."""
        if observed_s > 0:
            self.errors.observe(abs(predicted_s - observed_s) / observed_s)
