"""SubscribeKvEvents as the simulator serves it by default: as smg-grpc-servicer 0.14.1's
Python relay does (``--kv-relay python``): live only, batches numbered from 0 per rank,
OUT_OF_RANGE for a cursor, DATA_LOSS for a lost batch, the load record on every batch
and heartbeats once a batch has gone (hosted workers, tests/sim/conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway_sim.relay_python import OUT_OF_RANGE_MESSAGE
from tests.sim.kv import (
    RUNTIMES,
    WAIT_S,
    Engine,
    Feed,
    engine,
    hashes,
    kinds,
    prompt,
    removed_of,
    stored_of,
)
from tests.support.sim import StartSim


@asynccontextmanager
async def subscribed(eng: Engine) -> AsyncIterator[Feed]:
    """A subscription from 0, once the relay has it: its headers say so."""
    async with eng.subscribe() as feed:
        await asyncio.wait_for(feed.call.initial_metadata(), WAIT_S)
        yield feed


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_live_only_numbered_from_zero(start_sim: StartSim, runtime: str) -> None:
    """Headers at once, then no snapshot and no history: the batches published from
    the subscription on, numbered from 0 as the rank's publisher numbers them; event ids
    count per stream; a later subscriber starts at what is published after it."""
    sim = start_sim("--runtime", runtime, "--block-size", "4")
    async with engine(sim, runtime) as eng:
        await eng.generate(prompt(9, 100))  # batch 0, before anyone subscribed
        async with subscribed(eng) as feed:  # its headers came at once
            await asyncio.sleep(0.3)
            assert feed.pending() == []  # nothing until a batch is published
            await eng.generate(prompt(9, 200))
            first = await feed.next()
            await eng.generate(prompt(13, 200))  # one more block under those two
            second = await feed.next()
            async with subscribed(eng) as late:
                await eng.generate(prompt(5, 300))
                live, late_live = await feed.next(), await late.next()

    assert (first.sequence_number, first.dp_rank) == (1, 0)
    assert not first.HasField("snapshot") and not first.load.load_only
    assert [list(b.token_ids) for s in stored_of(first) for b in s.blocks] == [
        prompt(4, 200),
        prompt(4, 204),
    ]
    assert [(second.sequence_number, live.sequence_number)] == [(2, 3)]
    assert late_live.sequence_number == 3
    [child] = stored_of(second)
    assert child.parent_block_hash == hashes(stored_of(first)[-1])[-1]
    assert [e.event_id for e in (*first.events, *second.events, *live.events)] == list(
        range(1, 1 + len(first.events) + len(second.events) + len(live.events))
    )
    assert [e.event_id for e in late_live.events] == list(range(1, 1 + len(late_live.events)))
    # Samples count every record on the stream, heartbeats (when a call ends) included.
    assert [first.load.sample, second.load.sample] == [1, 2] and live.load.sample >= 3
    assert late_live.load.sample == 1


async def test_publisher_shapes_per_engine(start_sim: StartSim) -> None:
    """vLLM's publisher stores a run of blocks in one event and names its medium and
    cache group; SGLang's stores one page an event and names neither."""
    vllm = start_sim("--runtime", "vllm", "--block-size", "4")
    sglang = start_sim("--block-size", "4")
    batches = {}
    for name, sim in (("vllm", vllm), ("sglang", sglang)):
        async with engine(sim, name) as eng, subscribed(eng) as feed:
            await eng.generate(prompt(9))
            batches[name] = await feed.next()
    [run] = stored_of(batches["vllm"])
    assert [list(b.token_ids) for b in run.blocks] == [prompt(4), prompt(4, 104)]
    assert (run.medium, run.group_idx) == ("GPU", 0)
    pages = stored_of(batches["sglang"])
    assert [len(p.blocks) for p in pages] == [1, 1]
    assert pages[1].parent_block_hash == pages[0].blocks[0].block_hash
    assert not pages[0].HasField("medium") and not pages[0].HasField("group_idx")
    for stored in (run, *pages):
        assert stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
        assert stored.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL
        assert all(block.block_size == 4 for block in stored.blocks)


async def test_vllm_first_batch_begins_with_cleared(start_sim: StartSim) -> None:
    """The servicer's warm-up flushes the cache as the worker starts; vLLM publishes the
    `cleared` with its first step's events, and names the stores' cache group kind."""
    sim = start_sim("--runtime", "vllm", "--block-size", "4")
    async with engine(sim, "vllm") as eng, subscribed(eng) as feed:
        await eng.generate(prompt(5))
        first = await feed.next()
        await eng.generate(prompt(5, 200))
        second = await feed.next()
    assert kinds(first) == ["cleared", "stored"] and kinds(second) == ["stored"]
    assert [e.event_id for e in (*first.events, *second.events)] == [1, 2, 3]
    assert stored_of(first)[0].kv_cache_spec_kind == "full_attention"


async def test_removals_one_block_an_event(start_sim: StartSim) -> None:
    sim = start_sim("--runtime", "vllm", "--block-size", "4", "--kv-blocks", "2")
    async with engine(sim, "vllm") as eng, subscribed(eng) as feed:
        await eng.generate(prompt(9, 100))
        stored = stored_of(await feed.next())[0]
        await eng.generate(prompt(9, 200))
        evicting = await feed.next()
    assert kinds(evicting) == ["removed", "removed", "stored"]
    assert removed_of(evicting) == hashes(stored)[::-1]  # tail first
    assert all(e.removed.medium == "GPU" for e in evicting.events[:2])


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_cursor_is_out_of_range(start_sim: StartSim, runtime: str) -> None:
    sim = start_sim("--runtime", runtime)
    async with engine(sim, runtime) as eng, eng.subscribe(5) as feed:
        error = await feed.error()
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert error.details() == OUT_OF_RANGE_MESSAGE
    assert OUT_OF_RANGE_MESSAGE == (
        "KV event replay cursors are per subscription; resubscribe with zero and rebuild"
    )


async def test_load_records_and_heartbeats(start_sim: StartSim, strict: bool) -> None:
    """The first record carries everything, later event batches the routing core; no
    heartbeat before the first batch; then load-only batches repeating the last batch's
    rank and sequence: at once when the record moved, else every interval, and at the
    backoff interval once two in a row carried the same record (their pace checked in
    the timing tier; on a busy machine the order and the records)."""
    sim = start_sim(
        "--block-size", "4", "--kv-heartbeat-ms", "100", "--kv-heartbeat-backoff-ms", "600",
        "--load-waiting", "3", "--dp-ranks", "2",
    )  # fmt: skip
    slow = (("x-sim-token-ms", "50"),)  # still running as its batch is forwarded
    async with engine(sim) as eng, subscribed(eng) as feed:
        await asyncio.sleep(0.35)
        assert feed.pending() == []  # nothing to repeat yet
        await eng.generate(prompt(5), rank=1, metadata=slow)
        first = await feed.next(heartbeats=True)
        await eng.generate(prompt(5, 200), rank=1, metadata=slow)
        second = await feed.next()  # (a heartbeat may come between: the call ended)
        since = time.monotonic()
        beats, arrived = [], []
        for _ in range(4):
            beats.append(await feed.next(heartbeats=True))
            arrived.append(time.monotonic() - since)
    assert (first.dp_rank, first.sequence_number, first.load.load_only) == (1, 0, False)
    assert first.load.running_requests == 1  # stored as its prefill ends: still running
    assert first.load.max_total_num_tokens == 4 * 4096 and first.load.max_running_requests == 4096
    assert first.load.waiting_requests == 0  # rank 1's; rank 0 waits 3
    assert second.load.max_total_num_tokens == 0  # telemetry: first record and heartbeats
    assert second.load.max_running_requests == 4096  # the core
    assert [(b.dp_rank, b.sequence_number, b.load.load_only) for b in beats] == [(1, 1, True)] * 4
    assert all(not b.events and b.load.max_total_num_tokens == 4 * 4096 for b in beats)
    assert beats[0].load.running_requests == 0  # the call ended: the record moved
    samples = [b.load.sample for b in (second, *beats)]
    assert first.load.sample == 1 and samples == list(range(samples[0], samples[0] + 5))
    if strict:
        assert arrived[0] < 0.3  # moved: within a tick
        assert 0.05 <= arrived[1] - arrived[0] < 0.5 and 0.05 <= arrived[2] - arrived[1] < 0.5
        assert arrived[3] - arrived[2] >= 0.5  # the backoff after two unchanged


async def test_a_moving_load_beats_at_once(start_sim: StartSim, strict: bool) -> None:
    """A record that moves (a call ends, a call starts) goes out within a tick, not an
    interval: the interval is two minutes, so no clock need be read (the timing tier
    checks the tick: within 1 s)."""
    sim = start_sim("--block-size", "4", "--kv-heartbeat-ms", "120000")
    async with engine(sim) as eng, subscribed(eng) as feed:
        await eng.generate(prompt(5), metadata=(("x-sim-token-ms", "100"),))
        assert (await feed.next()).load.running_requests == 1
        ended = await feed.next(heartbeats=True)
        running = asyncio.ensure_future(  # three tokens: no full block, no batch
            eng.generate(prompt(3, 300), tokens=3, metadata=(("x-sim-token-ms", "400"),))
        )
        started = time.monotonic()
        beat = await feed.next(heartbeats=True)
        waited = time.monotonic() - started
        await running
    assert ended.load.load_only and ended.load.running_requests == 0
    assert beat.load.load_only and beat.load.running_requests == 1
    if strict:
        assert waited < 1.0


async def test_a_lost_batch_ends_the_stream(start_sim: StartSim) -> None:
    """The publisher keeps no replay buffer: a gap in a rank's sequence ends the stream
    DATA_LOSS."""
    sim = start_sim("--block-size", "4", "--kv-drop-rate", "0.5")
    async with engine(sim) as eng, subscribed(eng) as feed:
        for i in range(60):
            await eng.generate(prompt(5, 100 + i))
        error = await feed.error()
    assert error.code() == grpc.StatusCode.DATA_LOSS
    assert "jumped from batch" in (error.details() or "")


async def test_a_slow_subscriber_loses_batches_then_data_loss(start_sim: StartSim) -> None:
    """A subscriber that stops reading loses what does not fit its queue (as a ZMQ
    subscriber past its high-water mark): once it reads again, the gap ends it
    DATA_LOSS at the next batch; a reading subscriber gets every batch."""
    sim = start_sim(
        "--kv-queue", "4", "--kv-heartbeat-ms", "0", "--block-size", "16",
        "--max-model-len", "8192", "--vocab-size", "32000",
    )  # fmt: skip
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    requests = 30
    async with (
        grpc.aio.insecure_channel(sim.address, options=small_window) as slow_channel,
        engine(sim) as eng,
        subscribed(eng) as reader,
    ):
        stalled: Any = sgl_grpc.SglangSchedulerStub(slow_channel).SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest()
        )
        await stalled.initial_metadata()
        sequences = []
        for i in range(requests):  # 256 blocks (some 16 KiB of events) each
            await eng.generate(prompt(4096, 1000 + i), tokens=1, stream=False)
            sequences.append((await reader.next()).sequence_number)

        async def read_all() -> int:
            received = 0
            async for _ in stalled:
                received += 1
            return received

        reading = asyncio.ensure_future(read_all())
        for i in range(50):  # batches after the gap, until the stalled one sees it
            if reading.done():
                break
            await eng.generate(prompt(17, 200 + i), tokens=1, stream=False)  # a block
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await asyncio.wait_for(reading, WAIT_S)
    assert sequences == list(range(requests))
    assert error.value.code() == grpc.StatusCode.DATA_LOSS


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_ranks_flush_and_no_kv_events(start_sim: StartSim, runtime: str) -> None:
    sim = start_sim("--runtime", runtime, "--block-size", "4", "--dp-ranks", "2")
    bare = start_sim("--runtime", runtime, "--no-kv-events")
    async with engine(sim, runtime) as eng, subscribed(eng) as feed:
        await eng.generate(prompt(5), rank=0)
        await eng.generate(prompt(5), rank=1)
        await eng.generate(prompt(5, 300), rank=1)
        stored = await feed.take(3)
        await eng.flush()
        cleared = await feed.take(2)
    async with engine(bare, runtime) as eng, eng.subscribe() as feed:
        error = await feed.error()
    assert [(b.dp_rank, b.sequence_number) for b in stored] == [(0, 0), (1, 0), (1, 1)]
    assert sorted((b.dp_rank, b.sequence_number, kinds(b)[0]) for b in cleared) == [
        (0, 1, "cleared"),
        (1, 2, "cleared"),
    ]
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
