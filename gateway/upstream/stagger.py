"""Staggered work: hosts that join together are not joined, probed and polled together.

Hosts join in batches (a discovery report names hundreds at once, start-up names every
configured worker) and leave in batches. Joined in the same turn of the event loop, their
channels, questions and registrations would stall it for as long as all of them take
(0.8 s for 255 hosts), and so would their removals (0.3 s): each waits a random part of a
window that grows with their number instead (`spread`).
And loops that all started at the same tick and then waited one interval would probe and
poll every host at the same instant, forever, a burst of hundreds of calls every
interval: each loop's first wait is a random part of its interval (`waits`), then its
period is the interval, so the calls spread evenly over it. The first call itself is not
delayed (a new worker is probed at once).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator


def waits(interval_s: float, draw: Callable[[], float] = random.random) -> Iterator[float]:
    """The pauses of a loop that calls once, then every `interval_s`: the first a random
    part of the interval (`draw()`: uniform in [0, 1)), then the interval."""
    yield interval_s * draw()
    while True:
        yield interval_s


HOST_COST_S = 0.004  # about what joining or removing one host costs the event loop
MAX_SPREAD_S = 1.0


def spread(together: int, draw: Callable[[], float] = random.random) -> float:
    """How long a host waits before it starts joining (or leaving) while `together` hosts
    do (itself included): a random part of a window that grows with their number, so the
    channels, questions, registrations and log lines of hundreds spread over up to a
    second instead of stalling the event loop in one turn; next to nothing for a few."""
    return draw() * min(MAX_SPREAD_S, together * HOST_COST_S)
