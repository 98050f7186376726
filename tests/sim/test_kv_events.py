"""SubscribeKvEvents of the simulated engines (hosted workers, tests/sim/conftest.py), as
the Rust relay of smg-grpc-servicer's engine_servicer serves it (``--kv-relay rust``):
snapshots, live stored/removed/cleared events, resuming from a cursor, DATA_LOSS,
heartbeats, DP ranks, slow subscribers and engines without KV events. The default, the
Python relay (live only), is tests/sim/test_kv_relay.py's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

from tests.sim.kv import RUNTIMES, engine, hashes, kinds, prompt, stored_of
from tests.support.sim import StartSim

INT64 = range(-(2**63), 2**63)
# The Rust relay, and token ids past the tiny model's vocabulary.
RUST = ("--kv-relay", "rust", "--vocab-size", "32000")


def assert_device_store(stored: Any, blocks: list[list[int]], block_size: int) -> None:
    assert [list(block.token_ids) for block in stored.blocks] == blocks
    assert all(block.block_size == block_size for block in stored.blocks)
    assert all(block.block_hash in INT64 for block in stored.blocks)
    assert stored.tier == common_pb2.KV_CACHE_TIER_DEVICE and stored.medium == "GPU"
    assert stored.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_snapshot_then_live_stored_events(start_sim: StartSim, runtime: str) -> None:
    sim = start_sim(*RUST, "--runtime", runtime, "--block-size", "4")
    ten = prompt(10)
    async with engine(sim, runtime) as eng, eng.subscribe() as feed:
        snapshot = await feed.next()
        await eng.generate(ten)
        first = await feed.next()
        await eng.generate(ten + prompt(4, 700))  # one more full block under the two
        second = await feed.next()
        async with eng.subscribe() as late:
            late_snapshot = await late.next()
            await eng.generate(prompt(4, 900))
            live, late_live = await feed.next(), await late.next()

    # Nothing published yet: the snapshot takes sequence 1, live batches follow it.
    assert snapshot.sequence_number == 1 and snapshot.dp_rank == 0
    assert (snapshot.snapshot.index, snapshot.snapshot.count, snapshot.snapshot.blocks) == (0, 1, 0)
    assert kinds(snapshot) == ["cleared"]
    # The running window: SGLang's, vLLM's CPU backend's max_num_seqs.
    assert snapshot.load.max_running_requests == (4096 if runtime == "sglang" else 128)
    assert not snapshot.load.load_only

    assert first.sequence_number == 2 and first.dp_rank == 0 and not first.HasField("snapshot")
    [stored] = stored_of(first)
    assert_device_store(stored, [ten[:4], ten[4:8]], 4)
    assert not stored.HasField("parent_block_hash") and not stored.HasField("lora_name")
    assert len(set(hashes(stored))) == 2
    assert first.load.token_usage == pytest.approx(2 / 4096)

    assert second.sequence_number == 3
    [child] = stored_of(second)
    assert_device_store(child, [ten[8:] + prompt(2, 700)], 4)
    assert child.parent_block_hash == hashes(stored)[1]

    # A snapshot now: the three blocks as one chain, at the current sequence.
    assert late_snapshot.sequence_number == 3
    assert (late_snapshot.snapshot.count, late_snapshot.snapshot.blocks) == (1, 3)
    assert kinds(late_snapshot) == ["cleared", "stored"]
    [chain] = stored_of(late_snapshot)
    assert hashes(chain) == hashes(stored) + hashes(child)
    assert not chain.HasField("parent_block_hash")

    assert live.sequence_number == late_live.sequence_number == 4
    assert list(live.events) == list(late_live.events)
    assert [first.load.sample, second.load.sample, live.load.sample] == [2, 3, 4]
    assert late_live.load.sample == 2


async def test_snapshot_chunks_are_consecutive_and_end_at_the_sequence(
    start_sim: StartSim,
) -> None:
    sim = start_sim(*RUST, "--block-size", "1")
    long = prompt(600)
    async with engine(sim) as eng:
        await eng.generate(long)  # sequence 1: 600 blocks
        async with eng.subscribe() as feed:
            # More blocks than one chunk holds, but one sequence number: one big chunk.
            only = await feed.next()
        await eng.generate(prompt(3, 5000))
        await eng.generate(long[:300] + prompt(3, 6000))  # a branch off the long chain
        async with eng.subscribe() as feed:
            chunks = await feed.take(2)
            await eng.generate(prompt(2, 7000))
            live = await feed.next()

    assert only.sequence_number == 1
    assert (only.snapshot.index, only.snapshot.count, only.snapshot.blocks) == (0, 1, 600)
    assert sum(len(s.blocks) for s in stored_of(only)) == 600

    assert [c.sequence_number for c in chunks] == [2, 3]
    assert [(c.snapshot.index, c.snapshot.count, c.snapshot.blocks) for c in chunks] == [
        (0, 2, 606),
        (1, 2, 606),
    ]
    assert kinds(chunks[0])[0] == "cleared" and "cleared" not in kinds(chunks[1])
    seen: set[int] = set()
    for stored in stored_of(chunks[0]) + stored_of(chunks[1]):  # parents before children
        if stored.HasField("parent_block_hash"):
            assert stored.parent_block_hash in seen
        seen.update(hashes(stored))
    assert len(seen) == 606
    assert live.sequence_number == 4 and not live.HasField("snapshot")


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_resume_replays_exactly_the_missed_batches(start_sim: StartSim, runtime: str) -> None:
    sim = start_sim(*RUST, "--runtime", runtime, "--block-size", "4")
    async with engine(sim, runtime) as eng, eng.subscribe() as witness:
        await witness.next()  # snapshot, sequence 1
        async with eng.subscribe() as leaving:
            await leaving.next()
            await eng.generate(prompt(4, 100))
            cursor = (await leaving.next()).sequence_number
        for start in (200, 300, 400):
            await eng.generate(prompt(8, start))
        expected = await witness.take(4)  # 2 (seen), then 3, 4, 5 (missed)
        async with eng.subscribe(cursor) as back:
            replayed = await back.take(3)
            await eng.generate(prompt(4, 500))
            live = await back.next()
        async with eng.subscribe(5) as current:
            await eng.generate(prompt(4, 600))
            after_five = await current.take(2)

    assert cursor == 2
    assert [b.sequence_number for b in replayed] == [3, 4, 5]
    assert [list(b.events) for b in replayed] == [list(b.events) for b in expected[1:]]
    assert not any(b.HasField("snapshot") for b in replayed)
    assert live.sequence_number == 6
    assert [b.sequence_number for b in after_five] == [6, 7]  # 6 replayed, 7 live


async def test_data_loss_when_the_cursor_is_older_than_the_history(start_sim: StartSim) -> None:
    sim = start_sim(*RUST, "--block-size", "4", "--kv-history", "2")
    async with engine(sim) as eng:
        for start in (100, 200, 300, 400):  # sequences 1..4; 3 and 4 are kept
            await eng.generate(prompt(4, start))
        async with eng.subscribe(1) as lost:
            error = await lost.error()
        async with eng.subscribe(2) as kept:
            replayed = await kept.take(2)
        async with eng.subscribe() as fresh:
            snapshot = await fresh.next()
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "older than DP rank 0's history" in (error.details() or "")
    assert "batches 2..2 were dropped" in (error.details() or "")
    assert [b.sequence_number for b in replayed] == [3, 4]
    assert [list(stored_of(b)[0].blocks[0].token_ids) for b in replayed] == [
        prompt(4, 300),
        prompt(4, 400),
    ]
    assert snapshot.sequence_number == 4 and snapshot.snapshot.blocks == 4


async def test_heartbeats_are_load_only_and_repeat_the_last_sequence(
    start_sim: StartSim, strict: bool
) -> None:
    """Load-only batches repeating the last sequence, each record's sample counted on;
    the timing tier checks their pace too (one 100 ms interval after the snapshot)."""
    sim = start_sim(*RUST, "--block-size", "4", "--kv-heartbeat-ms", "100", "--load-waiting", "3")
    async with engine(sim) as eng, eng.subscribe() as feed:
        snapshot = await feed.next(heartbeats=True)
        since = time.monotonic()
        beat = await feed.next(heartbeats=True)
        quiet = time.monotonic() - since
        await eng.generate(prompt(4))
        stored = await feed.next(heartbeats=True)
        beats = await feed.take(2, heartbeats=True)
    assert snapshot.sequence_number == 1
    assert beat.sequence_number == 1 and beat.load.load_only and beat.dp_rank == 0
    assert not beat.events and not beat.HasField("snapshot")
    assert beat.load.waiting_requests == 3 and beat.load.max_running_requests == 4096
    if strict:
        assert 0.08 <= quiet < 1.0
    assert stored.sequence_number == 2 and not stored.load.load_only
    assert [(b.sequence_number, b.load.load_only) for b in beats] == [(2, True), (2, True)]
    samples = [b.load.sample for b in (snapshot, beat, stored, *beats)]
    assert samples == sorted(samples) and len(set(samples)) == 5


async def test_heartbeats_before_the_first_batch_only_when_asked(start_sim: StartSim) -> None:
    """A rank that has published nothing numbers its heartbeats 0, and only a subscriber
    that takes load records before the first batch gets them."""
    sim = start_sim(*RUST, "--block-size", "4", "--kv-heartbeat-ms", "50")
    async with (
        engine(sim) as eng,
        eng.subscribe(7, early_records=True) as early,
        eng.subscribe(7) as plain,
    ):
        beats = await early.take(2, heartbeats=True)
        await eng.generate(prompt(4))
        stored = await early.next()
        first = await plain.next(heartbeats=True)
    assert [(b.sequence_number, b.load.load_only) for b in beats] == [(0, True), (0, True)]
    assert stored.sequence_number == 1
    # The plain subscriber waited through those heartbeats and got the batch first.
    assert (first.sequence_number, first.load.load_only) == (1, False)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_flush_cache_clears_every_rank(start_sim: StartSim, runtime: str) -> None:
    sim = start_sim(*RUST, "--runtime", runtime, "--block-size", "4", "--dp-ranks", "2")
    tokens = prompt(8)
    async with engine(sim, runtime) as eng, eng.subscribe() as feed:
        await feed.take(2)  # the snapshots
        await eng.generate(tokens, rank=0)
        await eng.generate(tokens, rank=1)
        await feed.take(2)
        flushed = await eng.flush()
        cleared = await feed.take(2)
        after = await eng.generate(tokens, rank=1)
        stored = await feed.next()
    assert flushed.success
    assert [(b.dp_rank, b.sequence_number, kinds(b)) for b in cleared] == [
        (0, 3, ["cleared"]),
        (1, 3, ["cleared"]),
    ]
    assert all(b.load.token_usage == 0.0 for b in cleared)
    assert after.cached[-1] == 0
    assert (stored.dp_rank, stored.sequence_number) == (1, 4)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_dp_ranks_have_their_own_cache_and_sequence(
    start_sim: StartSim, runtime: str
) -> None:
    sim = start_sim(*RUST, "--runtime", runtime, "--block-size", "4", "--dp-ranks", "2")
    tokens = prompt(9)  # two full blocks, both hit (a hit stops short of the last token)
    async with engine(sim, runtime) as eng, eng.subscribe() as feed:
        snapshots = await feed.take(2)
        slow = eng.generate(tokens, rank=1, tokens=3, metadata=(("x-sim-token-ms", "200"),))
        running = asyncio.ensure_future(slow)
        on_one = await feed.next()  # published once the prefill is done: still running
        loads = await eng.loads()
        await running
        unranked = await eng.generate(tokens)
        on_zero = await feed.next()
        invalid = await eng.generate(tokens, rank=5)  # not a rank here: rank 0
        again_one = await eng.generate(tokens, rank=1)
        await eng.generate(prompt(4, 900), rank=1)
        next_one = await feed.next()
        if runtime == "vllm":
            info = await eng.stub.GetServerInfo(vllm_pb2.GetServerInfoRequest())
            dp_size = info.data_parallel_size
        else:
            info = await eng.stub.GetServerInfo(sgl_pb2.GetServerInfoRequest())
            dp_size = dict(info.server_args.items())["dp_size"]

    assert [(b.dp_rank, b.sequence_number) for b in snapshots] == [(0, 1), (1, 1)]
    assert (on_one.dp_rank, on_one.sequence_number) == (1, 2)
    assert on_one.load.running_requests == 1 and on_one.load.active_token_usage > 0
    assert loads == [0, 1]
    assert unranked.cached[-1] == 0  # rank 0's cache is not rank 1's
    assert (on_zero.dp_rank, on_zero.sequence_number) == (0, 2)
    assert hashes(stored_of(on_zero)[0]) == hashes(stored_of(on_one)[0])  # same process seed
    assert invalid.cached[-1] == 8 and again_one.cached[-1] == 8
    assert (next_one.dp_rank, next_one.sequence_number) == (1, 3)
    assert dp_size == 2


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_no_kv_events_is_unimplemented(start_sim: StartSim, runtime: str) -> None:
    sim = start_sim(*RUST, "--runtime", runtime, "--block-size", "4", "--no-kv-events")
    async with engine(sim, runtime) as eng:
        async with eng.subscribe() as feed:
            error = await feed.error()
        await eng.generate(prompt(9))
        again = await eng.generate(prompt(9))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert again.cached[-1] == 8  # the cache itself still works


async def test_a_slow_subscriber_is_dropped_not_buffered(start_sim: StartSim) -> None:
    """A subscriber that stops reading fills its flow-control window, then its queue of
    4 batches: it ends with RESOURCE_EXHAUSTED while a reading subscriber gets all."""
    sim = start_sim(
        *RUST, "--kv-queue", "4", "--kv-heartbeat-ms", "0", "--block-size", "16",
        "--max-model-len", "8192",
    )  # fmt: skip
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    requests = 30
    async with (
        grpc.aio.insecure_channel(sim.address, options=small_window) as slow_channel,
        engine(sim) as eng,
        eng.subscribe() as reader,
    ):
        stalled = sgl_grpc.SglangSchedulerStub(slow_channel).SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest()
        )
        await stalled.initial_metadata()
        await reader.next()  # the snapshot: both are subscribed
        for i in range(requests):  # 256 blocks (about 16 KiB of events) each
            await eng.generate(prompt(4096, 1000 + i), tokens=1, stream=False)
            await reader.next()
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in stalled:
                received += 1
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too slow" in (error.value.details() or "")
    assert received < requests
