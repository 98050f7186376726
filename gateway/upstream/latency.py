"""What a worker's time to first token and pace of tokens cost, learned online from the
gateway's own observations, by least squares with exponential forgetting (old
observations fade, so a worker that slows down or speeds up is followed within some tens
of calls):

- time to first token ~ w0 + w1 * the call's uncached prompt tokens + w2 * the worker's
  prefill backlog (uncached tokens of its calls not yet at their first message; both in
  thousands) + w3 * load (calls in flight there, the gateway's and others' as the worker
  last reported);
- time per output token (the mean gap between a stream's messages after the first) ~
  w0 + w1 * load: a decode step costs more the larger the running batch.

Time to first token is fitted by its relative error (each observation weighted by
1/observed^2), not its absolute one: a worker's times have a heavy tail its features do
not explain (a call that waited for a core, a scheduling stall of the engine), and in
plain least squares one stall ten times the usual time pulled every prediction up by a
good part of it (a real vLLM worker on CPU, calls of a usual 10-30 ms with one in six
stalled at 70-300 ms: a median error of 46-126% fitted plainly, 18-24% weighted, on a
quiet machine: see tests/engines/test_predicted_latency.py). The prediction is the usual time,
what a stall does not move; a worker slower on every call moves it as before, a little
later when it slows down (its older, faster observations weigh more: a twofold slowdown
is followed in some 50 calls instead of 25) and sooner when it speeds up.

Forgetting fades what recent calls no longer show, too: a worker sent only cache hits for
hundreds of calls (the same few uncached tokens each) shows nothing of what a miss costs
there. The fit's small ridge pulls toward the weights so far, not toward 0, so such a
cost keeps its last value. Pulled to 0, it faded (after 400 hits a 1,408-token miss was
predicted at 23 ms against a true 129), and the worker was sent whole prompts as if they
were hits: late in a long trace, 11 of 1,728 calls predicted at 21-32 ms took 109-300 ms.

Bounded by construction: a few weights and the sums of one small system per model,
whatever the traffic; an observation or a prediction is a few dozen float operations. No
sidecar, no training service. Kept on the worker (`Worker.latency`); its one writer is the
call observer (`learn`), its readers the policies that predict."""

from __future__ import annotations

import math
from typing import NamedTuple

from gateway.core.roles import Role
from gateway.observability.record import CallRecord, mean_gap

FORGET = 0.97  # each observation's weight against the one after it (~33 calls of memory)
MIN_SEEN = 8  # observations before a prediction is given (cold: None)
RIDGE = 1e-3  # keeps the system solvable while the features barely vary
PER_TOKENS = 1000.0  # uncached tokens are counted in thousands (weights of like size)
MAX_TTFT_S = 600.0  # an observation past this is no time to first token worth learning
MAX_PACE_S = 60.0  # nor is a gap past this a decode step
FLOOR_S = 0.001  # a time to first token's weight (1/t^2) counts it as at least this

Weights = tuple[float, ...]


class Fit:
    """Online weighted least squares of `n` features with forgetting: y ~ w . x."""

    __slots__ = ("_a", "_b", "_count", "_mass", "seen", "weights")

    def __init__(self, n: int) -> None:
        self._a = [[0.0] * n for _ in range(n)]  # the decayed sum of c x x^T
        self._b = [0.0] * n  # the decayed sum of c x y
        self._count = 0.0  # the decayed count of observations
        self._mass = 0.0  # the decayed sum of their weights c
        self.seen = 0
        self.weights: Weights | None = None

    def observe(self, x: tuple[float, ...], y: float, weight: float = 1.0) -> None:
        """One observation, counted `weight` times (its weight against the others')."""
        a, b = self._a, self._b
        for i, xi in enumerate(x):
            b[i] = b[i] * FORGET + weight * xi * y
            row = a[i]
            for j, xj in enumerate(x):
                row[j] = row[j] * FORGET + weight * xi * xj
        self._count = self._count * FORGET + 1.0
        self._mass = self._mass * FORGET + weight
        self.seen += 1
        # The ridge at the scale of the weights (RIDGE itself when every weight is 1),
        # toward the weights so far: what recent observations no longer tell apart keeps
        # its last value (see the module) instead of fading to 0.
        self.weights = solve(a, b, RIDGE * self._mass / self._count, self.weights)

    def ready(self) -> Weights | None:
        """The weights, once MIN_SEEN observations are in (cold: None)."""
        return self.weights if self.seen >= MIN_SEEN else None

    def predict(self, x: tuple[float, ...]) -> float | None:
        """w . x (never below 0); None until MIN_SEEN observations."""
        weights = self.ready()
        if weights is None:
            return None
        return max(0.0, sum(w * v for w, v in zip(weights, x, strict=True)))


def ttft_features(uncached: int, backlog: int, load: float) -> tuple[float, ...]:
    return (1.0, uncached / PER_TOKENS, backlog / PER_TOKENS, load)


class LatencyModel:
    """One worker's models: time to first token and time per output token (see the
    module)."""

    __slots__ = ("_pace", "_ttft")

    def __init__(self) -> None:
        self._ttft = Fit(4)
        self._pace = Fit(2)

    @property
    def seen(self) -> int:
        """Observations of time to first token (the model placement waits on)."""
        return self._ttft.seen

    def observe(self, uncached: int, backlog: int, load: float, ttft_s: float) -> None:
        """One call's time to first message, with what it was placed on."""
        if not (0.0 <= ttft_s <= MAX_TTFT_S) or min(uncached, backlog) < 0:
            return
        if not math.isfinite(load):
            return
        # Weighted by 1/t^2: least squares of the relative error (see the module).
        weight = 1.0 / max(ttft_s, FLOOR_S) ** 2
        self._ttft.observe(ttft_features(uncached, backlog, load), ttft_s, weight)

    def predict(self, uncached: int, backlog: int, load: float) -> float | None:
        """Seconds to the first message of a call with `uncached` prompt tokens placed
        behind `backlog` tokens at `load`; None until MIN_SEEN observations. (The dot
        product of `ttft_features` written out: placement predicts every candidate, every
        call.)"""
        weights = self._ttft.ready()
        if weights is None:
            return None
        w0, w1, w2, w3 = weights
        return max(0.0, w0 + (w1 * uncached + w2 * backlog) / PER_TOKENS + w3 * load)

    def observe_pace(self, load: float, pace_s: float) -> None:
        """One stream's mean time per message after the first, placed at `load`."""
        if 0.0 <= pace_s <= MAX_PACE_S and math.isfinite(load):
            self._pace.observe((1.0, load), pace_s)

    def predict_pace(self, load: float) -> float | None:
        """Seconds per output token of a stream running at `load`; None while cold."""
        return self._pace.predict((1.0, load))


def solve(
    a: list[list[float]], b: list[float], ridge: float = RIDGE, prior: Weights | None = None
) -> Weights | None:
    """(A + ridge I) w = b + ridge prior for an N x N A (the ridge pulls w toward `prior`,
    zeros if None), by Gaussian elimination with partial pivoting (None if it is singular
    even so)."""
    n = len(b)
    pulled = b if prior is None else [bi + ridge * pi for bi, pi in zip(b, prior, strict=True)]
    m = [[*a[i], pulled[i]] for i in range(n)]
    for i in range(n):
        m[i][i] += ridge
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


class Lesson(NamedTuple):
    """What one finished call teaches one worker's model."""

    worker: str
    uncached: int  # its prompt tokens prefilled there (its engine's count, else expected)
    backlog: int  # the worker's prefill backlog at placement
    load: float  # the worker's load at placement
    ttft_s: float | None  # seconds to its first message (its prompt's worker)
    pace_s: float | None  # mean seconds per message after the first (its decoding worker)


def lessons(record: CallRecord) -> tuple[Lesson, ...]:
    """What one finished call teaches its workers' models: its time to first message to
    the worker that took its prompt (a regular one, or the prefill of a PD pair), its
    pace to the one that decoded it (the same regular one, or the decode). None from a
    call no cache-aware policy placed, one that did not stream (its one message comes at
    the end: no time to first token), or one that failed or was retried (its time says
    nothing of the worker's speed); no pace from an n > 1 call (its streams interleave)."""
    seen, first, worker = record.placed_on, record.first_message_s, record.worker
    expected = record.expected_cached_tokens
    if seen is None or first is None or expected is None or worker is None:
        return ()
    if record.code != "OK" or record.retries or record.continued or record.messages < 2:
        return ()
    cached = record.cached_tokens if record.cached_tokens is not None else expected
    uncached = max(0, record.prompt_tokens - cached)
    pace = mean_gap(record.duration_s(), first, record.messages) if record.choices == 1 else None
    prefills = record.legs.get(Role.PREFILL)
    if not prefills:
        return (Lesson(worker, uncached, seen.backlog, seen.load, first, pace),)
    taught = [Lesson(prefills[-1], uncached, seen.backlog, seen.load, first, None)]
    decoded = record.paced_on
    if decoded is not None and pace is not None:
        taught.append(Lesson(worker, 0, 0, decoded.load, None, pace))
    return tuple(taught)


def learn(model: LatencyModel, taught: Lesson) -> None:
    """The lesson put into the worker's models."""
    if taught.ttft_s is not None:
        model.observe(taught.uncached, taught.backlog, taught.load, taught.ttft_s)
    if taught.pace_s is not None:
        model.observe_pace(taught.load, taught.pace_s)
