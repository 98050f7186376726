"""Warming predicted_latency's models in process: calls until every worker's is warm."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
