"""The routing benchmark's trace (bench_routing.py): T tenants with long system prompts,
S sessions of several turns that each extend the previous turn's prompt, interleaved;
and the oracle: the hit rate one worker with all the capacity would reach on it."""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict
from dataclasses import dataclass

VOCAB = 30_000


@dataclass(frozen=True)
class Turn:
    session: str
    lora: str
    tokens: list[int]


def make_trace(args: argparse.Namespace) -> list[Turn]:
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(VOCAB) for _ in range(args.system_tokens)] for _ in range(args.tenants)
    ]
    loras = ["adapter-a" if t % 4 == 3 else "" for t in range(args.tenants)]
    sessions = []
    for s in range(args.sessions):
        tenant = rng.randrange(args.tenants)
        sessions.append((f"s{s}", tenant, list(systems[tenant])))
    trace: list[Turn] = []
    for _ in range(args.turns):
        order = list(range(len(sessions)))
        rng.shuffle(order)
        for index in order:
            name, tenant, history = sessions[index]
            history += [rng.randrange(VOCAB) for _ in range(args.turn_tokens)]
            trace.append(Turn(name, loras[tenant], list(history)))
    return trace


def oracle_hit_rate(trace: list[Turn], capacity_blocks: int, block_size: int) -> float:
    """One worker with all the capacity: an LRU over chained blocks, namespace-aware."""
    cache: OrderedDict[int, None] = OrderedDict()
    cached = prompt = 0
    for turn in trace:
        parent = hash(("root", turn.lora))
        hashes = []
        for i in range(0, len(turn.tokens) - block_size + 1, block_size):
            parent = hash((parent, *turn.tokens[i : i + block_size]))
            hashes.append(parent)
        hit = 0
        for h in hashes:
            if h not in cache:
                break
            hit += 1
        cached += hit * block_size
        prompt += len(turn.tokens)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return cached / prompt
