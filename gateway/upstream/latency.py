"""What a worker's time to first token costs, learned online from the gateway's own
observations: TTFT ~ w0 + w1 * uncached prompt tokens (thousands) + w2 * load (calls in
flight there, the gateway's and others' as the worker last reported), by recursive least
squares with exponential forgetting (old observations fade, so a worker that slows down
or speeds up is followed within some tens of calls).

Bounded by construction: three weights and the sums of one 3x3 system, whatever the
traffic; an observation or a prediction is a few dozen float operations. No sidecar, no
training service. Kept on the worker (`Worker.latency`); its one writer is the call
observer (`learn`), its readers the policies that predict."""

from __future__ import annotations

import math

from gateway.observability.record import CallRecord

FORGET = 0.97  # each observation's weight against the one after it (~33 calls of memory)
MIN_SEEN = 8  # observations before a prediction is given (cold: None)
RIDGE = 1e-3  # keeps the system solvable while the features barely vary
PER_TOKENS = 1000.0  # uncached tokens are counted in thousands (weights of like size)
MAX_TTFT_S = 600.0  # an observation past this is no time to first token worth learning


def features(uncached: int, load: float) -> tuple[float, float, float]:
    return (1.0, uncached / PER_TOKENS, load)


class LatencyModel:
    """One worker's TTFT model (see the module)."""

    __slots__ = ("_a", "_b", "seen", "weights")

    def __init__(self) -> None:
        self._a = [[0.0] * 3 for _ in range(3)]  # the decayed sum of x x^T
        self._b = [0.0] * 3  # the decayed sum of x y
        self.seen = 0
        self.weights: tuple[float, float, float] | None = None

    def observe(self, uncached: int, load: float, ttft_s: float) -> None:
        """One call's time to first message, with what it was placed on."""
        if not (0.0 <= ttft_s <= MAX_TTFT_S) or uncached < 0 or not math.isfinite(load):
            return
        x = features(uncached, load)
        a, b = self._a, self._b
        for i in range(3):
            b[i] = b[i] * FORGET + x[i] * ttft_s
            row = a[i]
            for j in range(3):
                row[j] = row[j] * FORGET + x[i] * x[j]
        self.seen += 1
        self.weights = solve(a, b)

    def predict(self, uncached: int, load: float) -> float | None:
        """Seconds to the first message of a call with `uncached` prompt tokens placed at
        `load`; None until MIN_SEEN observations."""
        weights = self.weights
        if weights is None or self.seen < MIN_SEEN:
            return None
        x = features(uncached, load)
        return max(0.0, weights[0] * x[0] + weights[1] * x[1] + weights[2] * x[2])


def solve(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """(A + RIDGE I) w = b for a 3x3 A, by Gaussian elimination with partial pivoting
    (None if it is singular even so)."""
    m = [[*a[i], b[i]] for i in range(3)]
    for i in range(3):
        m[i][i] += RIDGE
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            factor = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= factor * m[col][c]
    w = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        w[r] = (m[r][3] - sum(m[r][c] * w[c] for c in range(r + 1, 3))) / m[r][r]
    return (w[0], w[1], w[2])


def lesson(record: CallRecord) -> tuple[str, int, float, float] | None:
    """What one finished call teaches its worker's model: (worker, uncached tokens, load
    at placement, seconds to its first message); None for a call placed without a load
    (no latency-learning policy placed it), one without a first message, or one that
    failed (its time says nothing of the worker's speed)."""
    load, first = record.placed_load, record.first_message_s
    expected, worker = record.expected_cached_tokens, record.worker
    if load is None or first is None or expected is None or worker is None:
        return None
    if record.code != "OK" or record.retries or record.continued:
        return None
    return worker, max(0, record.prompt_tokens - expected), load, first
