"""Routing work on the event loop under cache_aware placement (not a test).

Prints, as ratios to the targets of issue 14:
- loop time to place a 128k-token prompt that 8 hosts hold (target <= 5 ms): hashing
  ahead on the offload thread (`Prefix.prepare`, as the front does), then the pick;
- the stall of a small periodic task (a stand-in for another model's small call) while
  20 concurrent 1M-token prompts are hashed and placed (target <= 100 ms); with
  `--decode`, each prompt is also decoded from its GenerateRequest bytes on the loop, as
  the front does before placement (not part of the KV code's budget: shown apart).

    .venv/bin/python scripts/bench/bench_prefix.py [--decode] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import numpy as np
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang

from gateway.config import KvConfig, OutlierDetectionConfig, WorkerSpec
from gateway.core.offload import Offload
from gateway.core.roles import Runtime
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix
from gateway.placement.policies import Choice, Hints
from gateway.placement.policies.cache_aware import CacheAware
from gateway.upstream.signals.outlier import OutlierDetector
from gateway.upstream.worker import Worker

OFFLOAD = Offload()  # the gateway's one low-priority thread for long prompts

LOOP_TARGET_S = 0.005
STALL_TARGET_S = 0.100


def tokens(n: int, seed: int) -> Any:
    """A prompt as the front sees it: the repeated field of a decoded GenerateRequest."""
    rng = np.random.default_rng(seed)
    request = sglang.GenerateRequest()
    request.tokenized.input_ids.extend(rng.integers(0, 150_000, n, dtype=np.uint32).tolist())
    return sglang.GenerateRequest.FromString(request.SerializeToString()).tokenized.input_ids


def workers(n: int) -> list[Worker]:
    spec = [WorkerSpec("h", i + 1, "m", Runtime.SGLANG) for i in range(n)]
    return [Worker(s, "m", Runtime.SGLANG, OutlierDetector(OutlierDetectionConfig())) for s in spec]


def hold(index: KvIndex, hosts: list[Worker], prompt: Any, block_size: int) -> None:
    array = np.asarray(prompt, dtype=np.uint32)
    blocks = len(array) // block_size
    for n, host in enumerate(hosts):
        hashes = [n * 10_000_000 + i for i in range(blocks)]
        index.store_tokens((host.id, 0), hashes, array[: blocks * block_size], None)


async def place_128k(rounds: int) -> float:
    index = KvIndex()
    hosts = workers(8)
    prompt = tokens(128 * 1024, 1)
    hold(index, hosts, prompt, 16)
    policy = CacheAware(index, KvConfig(), stale_after_s=3)
    times = []
    for _ in range(rounds):
        prefix = Prefix(prompt)
        await prefix.prepare(policy.block_sizes() | {16}, OFFLOAD)  # in a thread (numpy)
        start = time.perf_counter()
        chosen = policy.choose(hosts, Hints(prefix=prefix))
        times.append(time.perf_counter() - start)
        assert isinstance(chosen, Choice) and chosen.expected_cached == 128 * 1024
    return statistics.median(times)


async def stall_1m(concurrency: int, decode: bool) -> tuple[float, float]:
    """(worst stall of a 1 ms ticker, wall time) while `concurrency` 1M prompts route."""
    index = KvIndex()
    hosts = workers(4)
    cached = tokens(1_000_000, 2)
    hold(index, hosts[:2], cached, 16)
    policy = CacheAware(index, KvConfig(), stale_after_s=3)
    raws = []
    for n in range(concurrency):
        request = sglang.GenerateRequest()
        ids = cached if n % 2 else tokens(1_000_000, 100 + n)
        request.tokenized.input_ids.extend(ids)
        raws.append(request.SerializeToString())
    prompts = [sglang.GenerateRequest.FromString(raw).tokenized.input_ids for raw in raws]
    worst = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - start - 0.001)

    async def route(n: int) -> None:
        await asyncio.sleep(random.random() * 0.01)
        if decode:
            prompt = sglang.GenerateRequest.FromString(raws[n]).tokenized.input_ids
        else:
            prompt = prompts[n]
        prefix = Prefix(prompt)
        await prefix.prepare(policy.block_sizes() | {16}, OFFLOAD)
        policy.pick(hosts, Hints(prefix=prefix))

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    await asyncio.gather(*(route(n) for n in range(concurrency)))
    wall = time.perf_counter() - start
    done.set()
    await tick
    return worst, wall


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--decode", action="store_true")
    args = parser.parse_args()
    loop_s = await place_128k(args.rounds)
    print(
        f"place 128k over 8 hosts: {loop_s * 1000:.2f} ms of loop time "
        f"({loop_s / LOOP_TARGET_S:.2f}x the 5 ms target)"
    )
    stalls = []
    for _ in range(max(1, args.rounds // 2)):
        stall, wall = await stall_1m(args.concurrency, decode=False)
        stalls.append(stall)
    stall = statistics.median(stalls)
    print(
        f"{args.concurrency} concurrent 1M prompts: worst loop stall {stall * 1000:.1f} ms "
        f"({stall / STALL_TARGET_S:.2f}x the 100 ms target), {wall:.2f} s wall"
    )
    if args.decode:
        stall, wall = await stall_1m(args.concurrency, decode=True)
        print(
            f"  with the front's decode on the loop as well: {stall * 1000:.1f} ms "
            f"({stall / STALL_TARGET_S:.2f}x), {wall:.2f} s wall"
        )


if __name__ == "__main__":
    asyncio.run(main())
