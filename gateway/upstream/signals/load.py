"""A worker's load report: what GetLoads polls (`gateway.upstream.load.poller`) and a KV event
batch's load record (`gateway.upstream.load.kv_events`) both produce, and placement reads.

A leaf module (the standard library only), below the fleet and the KV index that both
write it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

MAX_KV_TOKENS = 10**12  # more than any accelerator holds: a bogus figure


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
    kv_tokens: int | None = None  # its KV cache's size in tokens (per DP rank), if it says

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
        kv_tokens: int | None = None,
    ) -> LoadReport:
        """A report from a worker's figures: each one out of range (NaN, infinite,
        negative, overflowing) is ignored, the previous report's (or 0) kept instead."""
        before = (previous.running, previous.waiting, previous.token_usage) if previous else None
        (run, wait, usage), bad = kept_good((running, waiting, token_usage), before)
        kept = previous.kv_tokens if previous else None
        if kv_tokens is not None and not 0 < kv_tokens <= MAX_KV_TOKENS:
            kv_tokens, bad = kept, bad + 1
        rejected = (previous.rejected if previous else 0) + bad
        return cls(run, wait, usage, at, own, rejected, kv_tokens if kv_tokens else kept)


Figures = tuple[int, int, float]  # running, waiting, token usage


def kept_good(figures: Figures, before: Figures | None) -> tuple[Figures, int]:
    """A worker's load figures, each one out of range (NaN, infinite, negative,
    overflowing) replaced by its previous value (or 0): the one rule for every way a
    worker reports its load; and how many were replaced."""
    running, waiting, usage = figures
    last = before if before is not None else (0, 0, 0.0)
    bad = 0
    if not LoadReport.count_ok(running):
        running, bad = last[0], bad + 1
    if not LoadReport.count_ok(waiting):
        waiting, bad = last[1], bad + 1
    if not LoadReport.usage_ok(usage):
        usage, bad = last[2], bad + 1
    return (running, waiting, usage), bad
