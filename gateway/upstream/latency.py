"""What a worker's time to first token costs, learned online from the gateway's own
observations: TTFT ~ w0 + w1 * the call's uncached prompt tokens + w2 * the worker's
prefill backlog (uncached tokens of its calls not yet at their first message; both in
thousands) + w3 * load (calls in flight there, the gateway's and others' as the worker
last reported), by least squares with exponential forgetting (old observations fade,
so a worker that slows down or speeds up is followed within some tens of calls).

Bounded by construction: four weights and the sums of one 4x4 system, whatever the
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


N = 4  # features: 1, uncached, backlog, load
Weights = tuple[float, ...]


def features(uncached: int, backlog: int, load: float) -> tuple[float, ...]:
    return (1.0, uncached / PER_TOKENS, backlog / PER_TOKENS, load)


class LatencyModel:
    """One worker's TTFT model (see the module)."""

    __slots__ = ("_a", "_b", "seen", "weights")

    def __init__(self) -> None:
        self._a = [[0.0] * N for _ in range(N)]  # the decayed sum of x x^T
        self._b = [0.0] * N  # the decayed sum of x y
        self.seen = 0
        self.weights: Weights | None = None

    def observe(self, uncached: int, backlog: int, load: float, ttft_s: float) -> None:
        """One call's time to first message, with what it was placed on."""
        if not (0.0 <= ttft_s <= MAX_TTFT_S) or min(uncached, backlog) < 0:
            return
        if not math.isfinite(load):
            return
        x = features(uncached, backlog, load)
        a, b = self._a, self._b
        for i in range(N):
            b[i] = b[i] * FORGET + x[i] * ttft_s
            row = a[i]
            for j in range(N):
                row[j] = row[j] * FORGET + x[i] * x[j]
        self.seen += 1
        self.weights = solve(a, b)

    def predict(self, uncached: int, backlog: int, load: float) -> float | None:
        """Seconds to the first message of a call with `uncached` prompt tokens placed
        behind `backlog` tokens at `load`; None until MIN_SEEN observations."""
        weights = self.weights
        if weights is None or self.seen < MIN_SEEN:
            return None
        x = features(uncached, backlog, load)
        return max(0.0, sum(w * v for w, v in zip(weights, x, strict=True)))


def solve(a: list[list[float]], b: list[float]) -> Weights | None:
    """(A + RIDGE I) w = b for an N x N A, by Gaussian elimination with partial pivoting
    (None if it is singular even so)."""
    n = len(b)
    m = [[*a[i], b[i]] for i in range(n)]
    for i in range(n):
        m[i][i] += RIDGE
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    w = [0.0] * n
    for r in range(n - 1, -1, -1):
        w[r] = (m[r][n] - sum(m[r][c] * w[c] for c in range(r + 1, n))) / m[r][r]
    return tuple(w)


def lesson(record: CallRecord) -> tuple[str, int, int, float, float] | None:
    """What one finished call teaches its worker's model: (worker, uncached tokens, its
    backlog and load at placement, seconds to its first message); None for a call no
    cache-aware policy placed, one without a first message, or one that failed (its
    time says nothing of the worker's speed)."""
    seen, first = record.placed_on, record.first_message_s
    expected, worker = record.expected_cached_tokens, record.worker
    if seen is None or first is None or expected is None or worker is None:
        return None
    if record.code != "OK" or record.retries or record.continued:
        return None
    uncached = max(0, record.prompt_tokens - expected)
    return worker, uncached, seen.backlog, seen.load, first
