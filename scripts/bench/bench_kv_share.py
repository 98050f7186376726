#!/usr/bin/env python3
"""What sharing cache-aware placement's knowledge costs each placement (issue: shared
state through a store), in process, no network: a placement's `KvIndex.assume` alone,
the same with the shared follower's hook (packing the placement for the next message),
and applying one received placement on another gateway (`SharedAssumptions.apply`, per
placement of the batch). Not a test: prints microseconds and the ratios against the
plain assume, measured in the same run.

    python scripts/bench/bench_kv_share.py [--tokens 2048] [--placements 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.config import StateConfig
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix, seed_tag
from gateway.state.assumptions import HEAD, SharedAssumptions
from gateway.state.store import Store

WORKERS = [f"10.0.0.{i}:30000" for i in range(16)]


def prompts(count: int, tokens: int, block_size: int) -> list[Prefix]:
    rng = random.Random(1)
    made = []
    for _ in range(count):
        prefix = Prefix([rng.randrange(30_000) for _ in range(tokens)])
        prefix.compute([block_size])
        made.append(prefix)
    return made


def timed(run: object, label: str, count: int) -> float:
    began = time.perf_counter()
    run()  # type: ignore[operator]
    per = (time.perf_counter() - began) / count * 1e6
    print(f"{label:48} {per:8.2f} us")
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--placements", type=int, default=5000)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    made = prompts(args.placements, args.tokens, args.block_size)
    store = Store(StateConfig(url="redis://127.0.0.1:1/0"))  # never connected: no I/O here

    plain = KvIndex(args.block_size)

    def assume_plain() -> None:
        for i, prefix in enumerate(made):
            plain.assume((WORKERS[i % 16], 0), prefix, 0.0, None, args.block_size)

    shared_index = KvIndex(args.block_size)
    shared = SharedAssumptions(shared_index, store, lambda worker: True)
    batches: list[bytes] = []

    def assume_shared() -> None:
        for i, prefix in enumerate(made):
            shared_index.assume((WORKERS[i % 16], 0), prefix, 0.0, None, args.block_size)
            if len(shared._entries) >= 8:  # what a 20 ms flush would hold at 400 calls/s
                shared._seal()
        shared._seal()
        batches.extend(
            HEAD.pack(b"\x01" * 16, seed_tag(), count) + body for count, body in shared._ready
        )

    other = SharedAssumptions(KvIndex(args.block_size), store, lambda worker: True)

    applied_count = [0]

    def apply_elsewhere() -> None:
        for message in batches:
            applied_count[0] += other.apply(message)

    n = args.placements
    print(f"{n} placements of {args.tokens}-token prompts, {len(WORKERS)} workers")
    base = timed(assume_plain, "assume (no store)", n)
    with_hook = timed(assume_shared, "assume + packed for the store", n)
    applied = timed(apply_elsewhere, "applied on another gateway (per placement)", n)
    print(
        f"\nsharing costs the placing gateway {with_hook / base:.2f}x its assume "
        f"(+{with_hook - base:.1f} us), each other gateway {applied:.1f} us per placement"
    )


if __name__ == "__main__":
    main()
