"""Warming predicted_latency's models: in process, calls until every worker's is warm;
on synthetic data, a worker's time to first token and a latency model taught it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from gateway.upstream.latency import LatencyModel
from gateway_sim.client import collect, model_md, sgl_generate


async def warm_up(stub: Any, ready: Callable[[], bool], limit: int) -> int:
    """Generate calls for model `m` until `ready()`, at most `limit`: how many it took."""
    calls = 0
    while not ready():
        assert calls < limit, "every worker warm within a few explorations"
        request = sgl_generate(f"w{calls}", tokens=6)
        _, error = await collect(stub.Generate(request, metadata=model_md("m")))
        assert error is None
        calls += 1
    return calls


def ttft(uncached: int, load: float, speed: float = 1.0, backlog: int = 0) -> float:
    """20 ms, plus 80 us per uncached token (its own and those ahead) and 5 ms per call in
    flight, at `speed`."""
    return (0.020 + 80e-6 * (uncached + backlog) + 0.005 * load) / speed


def taught(model: LatencyModel, count: int, speed: float = 1.0, seed: int = 1) -> None:
    draw = random.Random(seed)
    for _ in range(count):
        uncached, load = draw.randrange(0, 4000), draw.randrange(0, 12)
        backlog = draw.randrange(0, 8000)
        seconds = ttft(uncached, load, speed, backlog) * draw.uniform(0.95, 1.05)
        model.observe(uncached, backlog, load, seconds)
