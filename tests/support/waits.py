"""The one way a test waits for a state: `until`, polled and bounded.

A test on a shared machine never sleeps and hopes: it waits for the state it needs (a
worker's in-flight count, a log line, a process's answer), polling a condition that may
be plain or async, with a bound that only a hang reaches."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

# Upper bound for every "wait until the gateway notices" loop: a safety net, which only
# a hang reaches (on a machine busy with other work, noticing can take seconds).
WAIT_S = 30.0


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    within_s: float = WAIT_S,
    *,
    what: str = "condition",
    every_s: float | None = None,
) -> None:
    """Return once `condition()` holds (awaited if it is async); AssertionError naming
    `what` if it has not within `within_s`. Polled every `every_s`: by default 5 ms for a
    plain condition (state in this process), 50 ms for an async one (it asks a process)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        held = condition()
        asked = inspect.isawaitable(held)
        if asked:
            held = await held  # type: ignore[misc]
        if held:
            return
        assert loop.time() < deadline, f"{what}: not met within {within_s:g} s"
        await asyncio.sleep(every_s if every_s is not None else (0.05 if asked else 0.005))
