"""Flow queue micro-benchmark: what one push costs when it must push out calls, or
cannot fit at all, with 250 / 500 / 1,000 / 2,000 lower-class calls queued.

Not a test. The crowd: `n` one-byte batch calls of n / 10 tenants and one big standard
call, the queue's bytes full (the attack measured: a flood of tiny `x-priority: batch`
calls, then big standard ones). Per `n`, the best of `--repeats` tries of:

- plain push: a standard call into the same crowd with room to spare (the baseline);
- push + pop: an interactive call pushed, then peeked and popped;
- push out 32: an interactive call that must push out 32 batch calls to fit;
- cannot fit: a standard call of another tenant that would not fit even with every
  batch call gone (the big call's tenant holds too few to lose one): refused.

Printed in microseconds and as ratios against the plain push of the same run (and the
same `n`). `--module` benchmarks another copy of gateway/flow/queue.py, e.g. an older one
copied aside, loaded from its file:

    python scripts/bench/bench_flow_queue.py
    python scripts/bench/bench_flow_queue.py --module /tmp/queue_before.py
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

SIZES = (250, 500, 1000, 2000)
BIG = 900  # bytes of the big standard call


def load(path: Path | None) -> ModuleType:
    if path is None:
        from gateway.flow import queue

        return queue
    name = "bench_flow_queue_module"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # for its dataclasses
    spec.loader.exec_module(module)
    return module


class Bench:
    def __init__(self, module: ModuleType, repeats: int) -> None:
        self.m = module
        self.repeats = repeats
        self.classes = (
            module.FlowClass("interactive", ttl_s=30),
            module.FlowClass("standard", ttl_s=60),
            module.FlowClass("batch", ttl_s=300, starvation_s=60),
        )

    def crowd(self, n: int, spare: int = 0) -> Any:
        """`n` one-byte batch calls and one big standard call; `spare` bytes free."""
        queue = self.m.FlowQueue(self.classes, lambda t: 1.0, 10 * n, n + BIG + spare)
        for i in range(n):
            queue.push(self.m.Waiter(f"t{i % (n // 10)}", 2, 1, 1, 0.0))
        queue.push(self.m.Waiter("heavy", 1, 1, BIG, 0.0))
        return queue

    def best(self, make: Callable[[], Any], run: Callable[[Any], object]) -> float:
        """Microseconds of `run(make())`, the best of the repeats (`make` not timed)."""
        times = []
        for _ in range(self.repeats):
            queue = make()
            gc.disable()  # as timeit does: a collection is not the queue's cost
            try:
                began = time.perf_counter()
                run(queue)
                times.append(time.perf_counter() - began)
            finally:
                gc.enable()
        return min(times) * 1e6

    def plain(self, queue: Any) -> None:
        queue.push(self.m.Waiter("other", 1, 1, 1, 0.0))

    def push_pop(self, queue: Any) -> None:
        queue.push(self.m.Waiter("chat", 0, 1, 1, 0.0))
        queue.pop(queue.peek(0.0))

    def push_out_32(self, queue: Any) -> None:
        pushed = queue.push(self.m.Waiter("chat", 0, 1, 32, 0.0))
        assert pushed is not None and len(pushed) == 32, pushed

    def cannot_fit(self, queue: Any) -> None:
        assert queue.push(self.m.Waiter("other", 1, 1, queue.count, 0.0)) is None

    def row(self, n: int) -> dict[str, float]:
        roomy = self.crowd(n, spare=1 << 20)
        full = self.crowd(n)
        return {
            "plain push": self.best(lambda: roomy, self.plain),
            "push + pop": self.best(lambda: roomy, self.push_pop),
            "push out 32": self.best(lambda: self.crowd(n), self.push_out_32),
            "cannot fit": self.best(lambda: full, self.cannot_fit),  # changes nothing
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", type=Path, help="a copy of gateway/flow/queue.py")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    module = load(args.module)
    capped = "max_pushed" in inspect.signature(module.FlowQueue).parameters
    print(f"{module.__file__} (pushes out at most {'max_pushed' if capped else 'any number'})")
    bench = Bench(module, args.repeats)
    bench.row(SIZES[0])  # warm up
    print(f"{'n':>6} " + "".join(f"{name:>24}" for name in bench.row(SIZES[0])))
    for n in SIZES:
        figures = bench.row(n)
        base = figures["plain push"]
        cells = [f"{us:10.1f} us {us / base:8.1f}x" for us in figures.values()]
        print(f"{n:>6} " + "".join(f"{cell:>24}" for cell in cells))


if __name__ == "__main__":
    main()
