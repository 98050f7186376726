"""One thread, at a lower CPU priority, for a long prompt's CPU work: decoding its token
ids and hashing its blocks.

Why one thread for all of it: numpy runs the array work without the GIL, but takes it
back between calls, and every thread that does so makes the event loop wait for it. With
the default executor (six threads here) 20 concurrent 1M-token prompts kept a small call
to another model waiting ~200 ms on this 2-core machine; queued on one thread, ~30 ms.
Long prompts then wait for each other, never other calls. Why a lower priority (nice +10,
Linux threads only): when the cores are busy, the event loop and grpc's own threads, which
every call needs, run first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

NICENESS = 10


def _lower_priority() -> None:
    """NICENESS above the process's own (a thread inherits it). Niceness is per thread on
    Linux (`setpriority` on the thread id); a no-op elsewhere or where it is refused."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)
        )


class Offload:
    """Runs CPU-heavy functions one at a time in its own low-priority thread (started on
    first use)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="offload", initializer=_lower_priority
            )
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Let the thread end once its current work is done (queued work is dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
