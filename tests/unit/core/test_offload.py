"""The offload thread: one thread for every long prompt's work, at a lower CPU priority."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from gateway.core.offload import NICENESS, Offload


def whoami() -> tuple[int, int]:
    tid = threading.get_native_id()
    return tid, os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness")
def test_work_runs_on_one_thread_niced_below_the_loop() -> None:
    async def main() -> list[tuple[int, int]]:
        offload = Offload()
        try:
            return await asyncio.gather(*(offload.run(whoami) for _ in range(8)))
        finally:
            offload.close()

    loop_tid, loop_nice = whoami()
    seen = asyncio.run(main())
    assert {tid for tid, _ in seen} - {loop_tid} == {seen[0][0]}  # one thread, not the loop's
    assert {nice for _, nice in seen} == {min(19, loop_nice + NICENESS)}
    assert whoami() == (loop_tid, loop_nice)  # the loop's own priority is untouched


def test_work_is_done_in_order_and_results_come_back() -> None:
    order: list[int] = []

    def square(n: int) -> int:
        order.append(n)
        return n * n

    async def main() -> list[int]:
        offload = Offload()
        try:
            return await asyncio.gather(*(offload.run(square, n) for n in range(5)))
        finally:
            offload.close()

    assert asyncio.run(main()) == [0, 1, 4, 9, 16]
    assert order == [0, 1, 2, 3, 4]
