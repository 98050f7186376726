"""The routing benchmark's trace (bench_routing.py): T tenants with long system prompts,
S sessions of several turns that each extend the previous turn's prompt, interleaved;
and the oracle: the hit rate one worker with all the capacity would reach on it."""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass

from gateway_sim.timing import Profile

VOCAB = 30_000


@dataclass(frozen=True)
class Turn:
    session: str
    lora: str
    tokens: list[int]
    tenant: int = 0


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
            trace.append(Turn(name, loras[tenant], list(history), tenant))
    return trace


def chain(turn: Turn, block_size: int) -> list[int]:
    """The turn's block hashes, each chained to its parent (namespaced by its adapter)."""
    parent = hash(("root", turn.lora))
    hashes = []
    for i in range(0, len(turn.tokens) - block_size + 1, block_size):
        parent = hash((parent, *turn.tokens[i : i + block_size]))
        hashes.append(parent)
    return hashes


def held_run(hashes: list[int], held: Container[int]) -> int:
    """How many of the chain's first blocks are all in `held`."""
    run = 0
    for h in hashes:
        if h not in held:
            break
        run += 1
    return run


def lru_hits(turns: list[Turn], capacity_blocks: int, block_size: int) -> list[int]:
    """Each turn's cached prompt tokens on one LRU cache of `capacity_blocks` that
    serves every turn (the simulator's eviction: least recently used first)."""
    cache: OrderedDict[int, None] = OrderedDict()
    cached = []
    for turn in turns:
        hashes = chain(turn, block_size)
        cached.append(held_run(hashes, cache) * block_size)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return cached


def oracle_hit_rate(trace: list[Turn], capacity_blocks: int, block_size: int) -> float:
    """One worker with all the capacity: an LRU over chained blocks, namespace-aware."""
    cached = lru_hits(trace, capacity_blocks, block_size)
    return sum(cached) / sum(len(turn.tokens) for turn in trace)


def partitioned_hit_rates(
    trace: list[Turn], workers: int, capacity_blocks: int, block_size: int, parts: int = 4
) -> list[float]:
    """The hit rate in each of `parts` stretches of the trace when every tenant lives on
    one worker (tenants dealt round the workers, each worker an LRU of
    `capacity_blocks`): no prefix is held twice, no session moves. What a policy loses
    late in the trace that this loses too is the caches' size, not the placement."""
    served: dict[int, list[tuple[int, Turn]]] = {}
    for n, turn in enumerate(trace):
        served.setdefault(turn.tenant % workers, []).append((n, turn))
    cached = [0] * len(trace)
    for turns in served.values():
        hits = lru_hits([turn for _, turn in turns], capacity_blocks, block_size)
        for (n, _), hit in zip(turns, hits, strict=True):
            cached[n] = hit
    rates = []
    for part in range(parts):
        lo, hi = part * len(trace) // parts, (part + 1) * len(trace) // parts
        prompt = sum(len(turn.tokens) for turn in trace[lo:hi])
        rates.append(sum(cached[lo:hi]) / max(1, prompt))
    return rates


def fleet_capacity(
    trace: list[Turn], profile: Profile, speeds: list[float], output_tokens: int, max_batch: int
) -> float:
    """Calls per second the fleet sustains on this trace under the simulator's timing
    model, every prompt token prefilled (no cache hit: a policy's hits lower its real
    load). A worker at speed s: its prefill lane takes P / tps / s a call (P the trace's
    mean prompt), its batch of B calls holds each for that plus (T - 1) gaps of
    ITL(B) / s (T output tokens); it sustains the lower of the two bounds,
    s x min(tps / P, B / (P / tps + (T - 1) x ITL(B))). The fleet: their sum."""
    mean_prompt = sum(len(turn.tokens) for turn in trace) / len(trace)
    prefill = profile.prefill_s(round(mean_prompt))
    held = prefill + max(output_tokens - 1, 0) * profile.itl_s(max_batch)
    per_worker = min(1.0 / prefill, max_batch / held)
    return float(sum(speed * per_worker for speed in speeds))


def unavoidable_misses(
    trace: list[Turn], profile: Profile, block_size: int, slo_s: float
) -> list[int]:
    """The calls (their places in the trace) no placement could serve within `slo_s`:
    even on an idle full-speed worker that holds every earlier prompt of the trace (an
    unbounded cache), prefilling what no earlier prompt shares with it takes longer (a
    tenant's first system prompt)."""
    seen: set[int] = set()
    late = []
    for n, turn in enumerate(trace):
        hashes = chain(turn, block_size)
        shared = held_run(hashes, seen)
        if profile.prefill_s(len(turn.tokens) - shared * block_size) > slo_s:
            late.append(n)
        seen.update(hashes)
    return late
