"""What one queue operation costs does not grow with the calls queued: counted as the
lines of gateway/flow/queue.py and its rankings (ranking.py) it runs (the same on a busy
machine), and timed against itself with 8 times fewer calls queued (a ratio, the best of
several tries)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from gateway.flow import queue as flow_queue
from gateway.flow import ranking as flow_ranking
from gateway.flow.queue import MAX_PUSHED_OUT, FlowQueue, Waiter
from tests.support.queues import CLASSES

SMALL, LARGE = 250, 2000  # 8x: linear work shows as ~8, quadratic as ~64
BIG = 900  # bytes of the big standard call that fills the queue with the tiny ones


def crowded(n: int, max_pushed: int = MAX_PUSHED_OUT) -> tuple[FlowQueue, list[Waiter]]:
    """`n` one-byte batch calls of n / 10 tenants and one big standard call: the bytes
    are full (the attack measured: a flood of tiny batch calls, then big calls)."""
    q = FlowQueue(CLASSES, lambda t: 1.0, 10 * n, max_bytes=n + BIG, max_pushed=max_pushed)
    queued = [Waiter(f"t{i % (n // 10)}", 2, 1, size=1, since=0) for i in range(n)]
    queued.append(Waiter("heavy", 1, 1, size=BIG, since=0))
    for w in queued:
        q.push(w)
    return q, queued


def lines_run(action: Callable[[], object]) -> int:
    """The lines of gateway/flow/queue.py and ranking.py that `action` runs."""
    count = 0
    modules = {flow_queue.__file__, flow_ranking.__file__}

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename in modules else None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        action()
    finally:
        sys.settrace(before)
    return count


Action = Callable[[FlowQueue, list[Waiter]], object]


def lines_ratio(action: Action, **crowd: Any) -> float:
    """Lines `action` runs on a crowd of LARGE over those on a crowd of SMALL."""
    small, large = crowded(SMALL, **crowd), crowded(LARGE, **crowd)
    return lines_run(lambda: action(*large)) / lines_run(lambda: action(*small))


def cannot_fit(q: FlowQueue, queued: list[Waiter]) -> None:
    """Even every batch call gone would not free the bytes (and "heavy" may not go)."""
    assert q.push(Waiter("other", 1, 1, size=len(queued), since=0)) is None


def pushes_out_32(q: FlowQueue, queued: list[Waiter]) -> None:
    assert len(q.push(Waiter("chat", 0, 1, size=32, since=0)) or ()) == 32


def test_a_push_that_cannot_fit_costs_the_same_with_2000_calls_below_as_with_250() -> None:
    """It is refused after at most `max_pushed` + 1 candidates, none pushed out."""
    assert lines_ratio(cannot_fit) < 2  # linear: 8


def test_a_push_that_pushes_out_32_costs_the_same_with_2000_calls_below_as_with_250() -> None:
    assert lines_ratio(pushes_out_32) < 2


def test_without_a_cap_pushing_out_everyone_is_linear_not_quadratic() -> None:
    def everyone(q: FlowQueue, queued: list[Waiter]) -> None:
        pushed = q.push(Waiter("chat", 0, 1, size=len(queued) - 1, since=0))
        assert pushed is not None and len(pushed) == len(queued) - 1  # all but "heavy"

    uncapped = 10 * LARGE
    assert lines_ratio(everyone, max_pushed=uncapped) < 16  # 8 x log n / log n': ~10
    assert lines_ratio(cannot_fit, max_pushed=uncapped) < 16


def test_peek_pop_and_remove_cost_the_same_with_2000_calls_queued_as_with_250() -> None:
    def each(q: FlowQueue, queued: list[Waiter]) -> None:
        q.remove(queued[len(queued) // 2])
        chosen = q.peek(0.0)
        assert chosen is not None
        q.pop(chosen)
        assert q.peek(0.0, lambda tenant: tenant != "heavy") is not None

    assert lines_ratio(each) < 2.5  # heaps: log 2000 / log 250 is 1.4


def test_a_push_that_cannot_fit_takes_about_as_long_with_2000_calls_below_as_with_250() -> None:
    """Timed: what the lines do not count (dicts, heaps in C). Quadratic was ~64x."""

    def best(n: int) -> float:
        crowd = crowded(n)
        times = []
        for _ in range(7):
            began = time.perf_counter()
            cannot_fit(*crowd)  # changes nothing: the same push again
            times.append(time.perf_counter() - began)
        return min(times)

    best(SMALL)  # warm
    assert best(LARGE) / best(SMALL) < 8
