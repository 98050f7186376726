"""The simulated engines' prefix cache, seen from Generate: cached_tokens, TTFT, LoRA
namespaces, LRU eviction and blocks in use (hosted sim workers, tests/sim/conftest.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from gateway_sim.prefix_cache import Block, Lease, PrefixCache
from tests.sim.kv import RUNTIMES, engine, hashes, kinds, prompt, removed_of, stored_of
from tests.support.serial import run_alone
from tests.support.sim import StartSim


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_cached_tokens_count_full_blocks_only(start_sim: StartSim, runtime: str) -> None:
    sim = start_sim("--runtime", runtime, "--block-size", "4")
    ten = prompt(10)  # two full blocks and a partial one
    async with engine(sim, runtime) as eng:
        first = await eng.generate(ten)
        again = await eng.generate(ten)
        whole = await eng.generate(ten, stream=False)
        # Shares only the first block (token 4 differs), then longer than the cached run.
        branch = await eng.generate([*ten[:4], 7, *ten[5:], *prompt(6, 500)])
        short = await eng.generate(ten[:3])  # no full block at all
        longer = await eng.generate([*ten, *prompt(6, 300)])  # 4 full blocks, 2 cached

    assert first.cached == [0, 0, 0]
    assert again.cached == [8, 8, 8]
    assert [m.WhichOneof("response") for m in again.messages] == ["chunk", "chunk", "complete"]
    assert whole.cached == [8] and whole.complete.prompt_tokens == 10
    assert branch.cached == [4, 4, 4]
    assert short.cached == [0, 0, 0]
    assert longer.cached == [8, 8, 8]
    assert longer.complete.prompt_tokens == 16


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_hit_stops_short_of_the_last_token(start_sim: StartSim, runtime: str) -> None:
    """The engine needs the last prompt token's logits: a prompt of exactly two blocks,
    both cached, is served one from the cache."""
    sim = start_sim("--runtime", runtime, "--block-size", "4")
    async with engine(sim, runtime) as eng:
        await eng.generate(prompt(8))
        exact = await eng.generate(prompt(8))
        one_more = await eng.generate(prompt(9))
    assert exact.cached[-1] == 4
    assert one_more.cached[-1] == 8


async def test_lora_namespaces_never_share_blocks(start_sim: StartSim) -> None:
    sim = start_sim("--block-size", "4")
    tokens = prompt(9)
    async with engine(sim) as eng:
        a1 = await eng.generate(tokens, lora="adapter-a")
        b1 = await eng.generate(tokens, lora="adapter-b")
        base = await eng.generate(tokens)
        a2 = await eng.generate(tokens, lora="adapter-a")
        b2 = await eng.generate(tokens, lora="adapter-b")
        base2 = await eng.generate(tokens)
    assert [x.complete.cached_tokens for x in (a1, b1, base)] == [0, 0, 0]
    assert [x.complete.cached_tokens for x in (a2, b2, base2)] == [8, 8, 8]


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_ttft_counts_the_uncached_tokens(
    start_sim: StartSim, runtime: str, strict: bool
) -> None:
    """5 ms a prompt token: 1.25 s for 250 new tokens; 50 ms once 240 are cached; the
    per-request TTFT override stays the base. Never sooner than that (a sleep is never
    short). A busy machine makes any call late, now and then by half a second, never
    early: the quickest of three cached calls is a fraction of the cold one (counting the
    cached tokens would make it as slow), and within a generous margin of its figure in
    the timing tier."""
    sim = start_sim(
        "--runtime", runtime, "--prefill-us-per-token", "5000", "--ttft-ms", "20",
        "--block-size", "16",
    )  # fmt: skip
    run_alone()
    tokens = prompt(250)  # 15 full blocks of 16 and a partial one
    based_md = (("x-sim-ttft-ms", "300"),)
    async with engine(sim, runtime) as eng:
        cold = await eng.generate(tokens)
        warm = [await eng.generate(tokens) for _ in range(3)]
        based = [await eng.generate(tokens, metadata=based_md) for _ in range(3)]
    assert cold.cached[0] == 0 and {a.cached[0] for a in warm + based} == {240}
    quickest_warm = min(a.first_at for a in warm)
    quickest_based = min(a.first_at for a in based)
    assert cold.first_at >= 1.26  # 20 + 1250 (to the millisecond)
    assert quickest_warm >= 0.06  # 20 + 50
    assert quickest_based >= 0.34  # 300 + 50
    assert quickest_warm < cold.first_at / 4 and quickest_based < cold.first_at / 2
    if strict:
        assert max(a.first_at for a in warm) < 0.2 and max(a.first_at for a in based) < 0.5


async def test_lru_eviction_tail_first_then_misses(start_sim: StartSim) -> None:
    """Four blocks of room: A and B fill it, A is used again, C evicts B (the least
    recently used) tail first; B then misses and A still hits."""
    sim = start_sim("--block-size", "4", "--kv-blocks", "4", "--kv-relay", "rust")
    a, b, c = prompt(9, 100), prompt(9, 200), prompt(9, 300)  # two full blocks each
    async with engine(sim) as eng, eng.subscribe() as feed:
        assert kinds(await feed.next()) == ["cleared"]
        await eng.generate(a)
        stored_a = stored_of(await feed.next())[0]
        await eng.generate(b)
        stored_b = stored_of(await feed.next())[0]
        assert (await eng.generate(a)).cached[-1] == 8  # a hit stores nothing
        await eng.generate(c)
        c_batch = await feed.next()
        again_b = await eng.generate(b)  # evicts A now (C is newer)
        b_batch = await feed.next()
        again_c = await eng.generate(c)
    assert kinds(c_batch) == ["removed", "stored"]
    assert removed_of(c_batch) == hashes(stored_b)[::-1]  # tail first
    assert [list(block.token_ids) for block in stored_of(c_batch)[0].blocks] == [c[:4], c[4:8]]
    assert again_b.cached[-1] == 0
    assert removed_of(b_batch) == hashes(stored_a)[::-1]
    assert again_c.cached[-1] == 8


async def test_blocks_in_use_are_not_evicted(start_sim: StartSim) -> None:
    """While A streams, its blocks stay: C, with B filling the rest of the room, evicts
    B instead. Once A ends it is evictable again, and counts as used when it ended."""
    sim = start_sim("--block-size", "4", "--kv-blocks", "4", "--kv-relay", "rust")
    a, b, c, d = prompt(9, 100), prompt(9, 200), prompt(9, 300), prompt(9, 400)
    async with engine(sim) as eng, eng.subscribe() as feed:
        await feed.next()  # the snapshot
        running = asyncio.ensure_future(
            eng.generate(a, tokens=3, metadata=(("x-sim-token-ms", "300"),))
        )
        stored_a = stored_of(await feed.next())[0]  # A's prefill is done: it now streams
        await eng.generate(b)
        stored_b = stored_of(await feed.next())[0]
        await eng.generate(c)
        c_batch = await feed.next()
        assert await eng.loads() == [1]  # A still runs
        assert (await running).cached[-1] == 0
        await eng.generate(b)
        b_batch = await feed.next()
        await eng.generate(d)
        d_batch = await feed.next()
    assert removed_of(c_batch) == hashes(stored_b)[::-1]
    assert removed_of(b_batch) == hashes(stored_of(c_batch)[0])[::-1]  # C: older than A's end
    assert removed_of(d_batch) == hashes(stored_a)[::-1]


# ------------------------------------------------------------------ in process


class Mirror:
    """A subscriber's view: applies the cache's changes and checks their order."""

    def __init__(self) -> None:
        self.live: dict[int, int | None] = {}  # hash -> parent hash

    def changed(self, removed: Sequence[int], stored: Sequence[Block]) -> None:
        for block_hash in removed:
            assert block_hash in self.live
            assert block_hash not in self.live.values(), "evicted before its child"
            del self.live[block_hash]
        for block in stored:
            parent = block.parent.block_hash if block.parent is not None else None
            assert parent is None or parent in self.live, "stored before its parent"
            self.live[block.block_hash] = parent

    def cleared(self) -> None:
        self.live.clear()


def test_random_workload_keeps_chains_whole_and_capacity() -> None:
    """Overlapping leases over a small shared vocabulary of prefixes: the events always
    describe the cache exactly, parents are never evicted before their children, and the
    cache stays within capacity except for blocks in use."""
    rng = random.Random(7)
    mirror = Mirror()
    cache = PrefixCache(2, 12, b"seed", mirror)
    leases: list[Lease] = []
    for step in range(3000):
        action = rng.random()
        if action < 0.5 or not leases:
            ids = [rng.randrange(3) for _ in range(rng.randrange(12))]
            lease = cache.admit(rng.choice(("", "lora")), ids)
            assert lease.cached_tokens % 2 == 0 and lease.cached_tokens <= len(ids)
            leases.append(lease)
        elif action < 0.8:
            cache.store(rng.choice(leases))
        elif action < 0.995:
            cache.release(leases.pop(rng.randrange(len(leases))))
        else:
            cache.flush()
        live = {b.block_hash: (b.parent.block_hash if b.parent else None) for b in cache.blocks()}
        assert live == mirror.live, f"step {step}"
        in_use = {id(b) for lease in leases for b in lease.blocks}
        assert len(cache) <= max(12, len(in_use))
    for lease in leases:
        cache.release(lease)
    assert len(cache) <= 12 and cache.active_usage == 0.0
