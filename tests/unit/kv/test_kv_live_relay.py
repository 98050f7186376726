"""The KV follower against a live-only relay, the way the real servicers (smg-grpc-servicer's
Python relay) answer: a subscription from 0 has no history and no snapshot, a non-zero start
is refused OUT_OF_RANGE, and a restarted engine numbers its batches from 1 again. A fake
channel plays the relay's side, one scripted subscription at a time (no network)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio
from smg_grpc_proto.generated import common_pb2 as kv

from gateway.config import KvConfig
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.upstream.load.kv_events import KvFollower
from tests.support.factories import worker_on
from tests.support.kv_events import batch, blocks, stored

SLOT = ("h:1", 0)

# One subscription's script: the batches it sends, then how it ends (a status code, or None
# to stay open: the last script's end is the test's).
Script = tuple[list[Any], grpc.StatusCode | None]


class Relay:
    """The worker's side: each subscription plays the next script and records its start.
    A non-zero start is refused OUT_OF_RANGE (live only) unless `replays`."""

    def __init__(self, *scripts: Script, replays: bool = False) -> None:
        self.scripts = list(scripts)
        self.replays = replays
        self.starts: list[int] = []
        self.done = asyncio.Event()

    def unary_stream(self, path: str, **_: Any) -> Callable[[Any], Subscription]:
        return self.subscribe

    def subscribe(self, request: kv.SubscribeKvEventsRequest, **_: Any) -> Subscription:
        self.starts.append(request.start_sequence_number)
        if request.start_sequence_number and not self.replays:
            return Subscription([], grpc.StatusCode.OUT_OF_RANGE, None)
        assert self.scripts, f"an unscripted subscription (from {request.start_sequence_number})"
        sent, code = self.scripts.pop(0)
        return Subscription(sent, code, None if self.scripts else self.done)

    async def close(self) -> None:
        pass


class Subscription:
    def __init__(
        self, sent: list[Any], code: grpc.StatusCode | None, last: asyncio.Event | None
    ) -> None:
        self.sent, self.code, self.last = sent, code, last

    def cancel(self) -> None:
        pass

    def done(self) -> bool:
        return False

    async def initial_metadata(self) -> aio.Metadata:
        return aio.Metadata()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[bytes]:
        for message in self.sent:
            yield message.SerializeToString()
        if self.code is not None:
            raise aio.AioRpcError(self.code, aio.Metadata(), aio.Metadata(), "scripted")
        if self.last is not None:
            self.last.set()
        await asyncio.Event().wait()  # open until cancelled


def follow(relay: Relay, index: KvIndex) -> KvFollower:
    follower = KvFollower(
        worker_on(),
        engine_adapters()[Runtime.SGLANG],
        index,
        settings=KvConfig(block_size=16, resubscribe_max_s=0.2),
        connect=lambda limit: relay,
    )
    return follower


async def run_until_scripts_done(follower: KvFollower, relay: Relay) -> None:
    task = asyncio.create_task(follower.run())
    try:
        await asyncio.wait_for(relay.done.wait(), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def store(sequence: int, first_hash: int, tokens: list[int]) -> Any:
    return batch(sequence, stored(blocks(tokens, first_hash)))


OLD = list(range(100, 132))  # two blocks the engine cached before it restarted
NEW = list(range(500, 532))


async def test_a_restarted_workers_batches_from_one_again_are_applied() -> None:
    """The engine restarts (the stream breaks), its counter starts over: the follower
    subscribes from 0, forgets its cursors and the worker's old entries, and applies the
    new engine's batches 1, 2, ... although the old cursor was past them."""
    before = [store(s, 1000 + 10 * s, OLD if s == 1 else []) for s in range(1, 40)]
    after = [store(1, 9000, NEW), batch(2)]
    relay = Relay((before, grpc.StatusCode.UNAVAILABLE), (after, None))
    index = KvIndex(block_size=16)
    follower = follow(relay, index)
    await run_until_scripts_done(follower, relay)
    assert relay.starts == [0, 0]
    assert index.knows(SLOT, 9000) and index.knows(SLOT, 9001)
    assert not index.knows(SLOT, 1010)  # the old engine's blocks: gone with it
    assert follower.cursors == {0: 2}
    assert follower.events["stored"] == 40


async def test_a_missed_batch_on_a_live_only_relay_rebuilds_from_zero_without_looping() -> None:
    """A gap: the follower tries to resume from its cursor once, gets OUT_OF_RANGE, and from
    then on subscribes from 0 (cursors cleared), so the next live batches are applied; a later
    gap goes straight to 0."""
    first = [store(1, 100, OLD), batch(2), batch(5)]  # 3 and 4 never arrived
    rebuilt = [store(7, 500, NEW), batch(8), batch(10)]  # 9 missed: a second gap
    again = [batch(11), batch(12)]
    relay = Relay((first, None), (rebuilt, None), (again, None))
    index = KvIndex(block_size=16)
    follower = follow(relay, index)
    await run_until_scripts_done(follower, relay)
    assert relay.starts == [0, 2, 0, 0]
    assert follower.resyncs == {"gap": 2, "out_of_range": 1}
    assert not follower.replays
    assert index.knows(SLOT, 500) is False  # dropped again by the second rebuild
    assert follower.cursors == {0: 12}


async def test_data_loss_and_a_relay_that_replays_keep_their_meaning() -> None:
    """A relay that can replay (history kept) is resumed from the cursor; DATA_LOSS starts
    over from 0 and drops the worker's entries."""
    relay = Relay(
        ([store(1, 100, OLD), batch(2), batch(4)], None),
        ([batch(3), batch(4)], grpc.StatusCode.DATA_LOSS),  # resumed from 2: replayed
        ([store(1, 700, NEW)], None),
        replays=True,
    )
    index = KvIndex(block_size=16)
    follower = follow(relay, index)
    await run_until_scripts_done(follower, relay)
    assert relay.starts == [0, 2, 0]
    assert follower.replays
    assert follower.resyncs == {"gap": 1, "data_loss": 1}
    assert index.knows(SLOT, 700) and not index.knows(SLOT, 100)
