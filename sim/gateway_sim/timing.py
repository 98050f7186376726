"""A simulated worker's timing model from published figures (``--timing NAME``), its batch
limit (``--max-batch``, the rest waiting FIFO) and its speed (``--speed``).

The one profile, ``h100x2-llama3.3-70b``, is fitted to NVIDIA's published NIM benchmark
tables for Llama-3.3-70B-Instruct on 2 x H100 80G (fp8, TP2, NIM 1.8.0):
"Performance", NVIDIA NIM LLM Benchmarking,
https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance (section "Llama-3.3-70b-instruct
Results", version 1.8.0). The figures used:

- time to first token at concurrency 1: 47.77 ms for 500 input tokens (the "500 Input
  Tokens / 2000 Output Tokens" table) and 406.77 ms for 5000 input tokens (the "5000
  Input Tokens / 500 Output Tokens" table). Their slope is the prefill throughput:
  4500 tokens / 359.0 ms = 12,535 tokens/s (the 7.9 ms left at 500 tokens is a fixed
  overhead, which ``--ttft-ms`` can add);
- inter-token latency by concurrency, 5000 in / 500 out: 18.58 ms at 1, 21.83 at 5,
  38.75 at 25, 59.73 at 50. A least-squares line through them gives
  ITL(batch) = 17.69 ms + 0.841 ms x batch. Past 50 the table flattens at 93 ms while
  its TTFT grows by tens of seconds: the engine's running batch is full and the rest
  queue, so the profile's default batch limit is 64.

The model, per DP rank of a worker (its ``Scheduler``):

- at most ``max_batch`` calls run; the others wait FIFO (at most ``max_queue``: past it
  a call is refused RESOURCE_EXHAUSTED), and their time to first token includes the wait;
- prefills run one at a time (a lane): a call's prefill of ``u`` uncached prompt tokens
  takes ``u / prefill_tokens_per_s`` and starts when the lane is free;
- each output token after the first takes ``ITL(running)`` where ``running`` is the
  number of calls admitted on the rank at that moment (decode does not wait for the
  prefill lane: a simplification, real engines interleave the two);
- ``--speed F`` divides every duration the worker takes (these, ``--ttft-ms``,
  ``--token-ms``, ``--prefill-us-per-token``) by ``F``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway_sim.active import ActiveRequest

NIM_SOURCE = (
    '"Performance", NVIDIA NIM LLM Benchmarking, '
    "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance "
    "(Llama-3.3-70b-instruct Results, version 1.8.0, 2 x H100 80G, fp8 TP2)"
)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b * x`` through ``points`` (two at least)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = sxy / sxx
    return mean_y - slope * mean_x, slope


@dataclass(frozen=True)
class Profile:
    """One GPU and model's published figures, and the lines fitted to them."""

    name: str
    hardware: str
    model: str
    source: str
    # (input tokens, time to first token in ms) at concurrency 1
    ttft_points: tuple[tuple[int, float], ...]
    # (concurrency, inter-token latency in ms)
    itl_points: tuple[tuple[int, float], ...]
    max_batch: int
    prefill_tokens_per_s: float = field(init=False)
    itl_base_ms: float = field(init=False)
    itl_per_seq_ms: float = field(init=False)

    def __post_init__(self) -> None:
        _, ms_per_token = fit_line(self.ttft_points)
        base, per_seq = fit_line(self.itl_points)
        object.__setattr__(self, "prefill_tokens_per_s", 1000.0 / ms_per_token)
        object.__setattr__(self, "itl_base_ms", base)
        object.__setattr__(self, "itl_per_seq_ms", per_seq)

    def prefill_s(self, tokens: int) -> float:
        """Seconds the prefill of ``tokens`` uncached prompt tokens takes (speed 1)."""
        return max(tokens, 0) / self.prefill_tokens_per_s

    def itl_s(self, batch: int) -> float:
        """Seconds between two output tokens with ``batch`` calls running (speed 1)."""
        return (self.itl_base_ms + self.itl_per_seq_ms * max(batch, 1)) / 1000.0


PROFILES = {
    profile.name: profile
    for profile in (
        Profile(
            name="h100x2-llama3.3-70b",
            hardware="2 x NVIDIA H100 80G (fp8, TP2)",
            model="Llama-3.3-70B-Instruct",
            source=NIM_SOURCE,
            ttft_points=((500, 47.77), (5000, 406.77)),
            itl_points=((1, 18.58), (5, 21.83), (25, 38.75), (50, 59.73)),
            max_batch=64,
        ),
    )
}


class QueueFull(Exception):
    """A call found the worker's waiting queue full."""


class Scheduler:
    """One DP rank's admission: at most ``limit`` calls running (None: no limit), the
    others waiting FIFO, at most ``max_queue`` of them; and its prefill lane."""

    def __init__(self, limit: int | None, max_queue: int) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.running = 0
        self._waiting: deque[ActiveRequest] = deque()
        self._granted: set[ActiveRequest] = set()
        self._lane_free_at = 0.0  # loop time the prefill lane is next free

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def admit(self, entry: ActiveRequest) -> bool:
        """Take a running slot, waiting FIFO for one; True if an Abort came first (no
        slot is then held). Raises ``QueueFull`` past ``max_queue`` waiting calls."""
        if self.limit is None or (self.running < self.limit and not self._waiting):
            self.running += 1
            return False
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"{len(self._waiting)} requests already waiting")
        self._waiting.append(entry)
        try:
            while entry not in self._granted and not entry.aborted:
                await entry.wait_signal()
        except BaseException:  # cancelled while waiting: give up the place or the slot
            self._forget(entry)
            raise
        if entry.aborted:
            self._forget(entry)
            return True
        self._granted.discard(entry)
        return False

    def leave(self) -> None:
        """A running call is done: its slot goes to the first waiting call."""
        self.running -= 1
        self._grant()

    def lane(self, seconds: float, now: float) -> float:
        """Book ``seconds`` of prefill on the lane at loop time ``now``; the delay until
        that prefill is done (its wait for the lane included)."""
        start = max(now, self._lane_free_at)
        self._lane_free_at = start + seconds
        return self._lane_free_at - now

    def _grant(self) -> None:
        while self._waiting and (self.limit is None or self.running < self.limit):
            entry = self._waiting.popleft()
            self.running += 1
            self._granted.add(entry)
            entry.signal()

    def _forget(self, entry: ActiveRequest) -> None:
        if entry in self._granted:  # granted as it gave up: pass the slot on
            self._granted.discard(entry)
            self.leave()
        elif entry in self._waiting:
            self._waiting.remove(entry)


def loop_time() -> float:
    return asyncio.get_running_loop().time()
