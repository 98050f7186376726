"""A call's latency objectives, as its headers state them (`x-slo-ttft-ms`,
`x-slo-tpot-ms`; `slo:` in the config), checked and bounded where they are read."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SLO_MS = 3_600_000.0  # an objective past an hour is no latency objective (refused)
MAX_SLO_CHARS = 16  # a longer value is no number of milliseconds worth parsing


@dataclass(frozen=True, slots=True)
class Slo:
    """Seconds to the first token and per output token after it (None: not asked);
    `sheddable`: the call may be refused when no worker is predicted to meet them."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    sheddable: bool = False

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool | None:
        """Whether observed times met every objective asked; None if one asked for was
        not observed (no first message; a stream of one message has no pace)."""
        for goal, seen in ((self.ttft_s, ttft_s), (self.tpot_s, tpot_s)):
            if goal is None:
                continue
            if seen is None:
                return None
            if seen > goal:
                return False
        return True


def parse_ms(value: str) -> float | None:
    """A header's milliseconds as seconds: a positive finite number up to MAX_SLO_MS;
    None for anything else (refused: INVALID_ARGUMENT)."""
    if len(value) > MAX_SLO_CHARS:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    if not math.isfinite(ms) or not 0.0 < ms <= MAX_SLO_MS:
        return None
    return ms / 1000.0
