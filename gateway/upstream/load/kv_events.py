"""Following one worker's KV events (`SubscribeKvEvents`) into the prefix index.

One subscription per worker carries every DP rank's batches; each rank has its own
sequence. The follower keeps a cursor per rank: a duplicate is skipped; a gap makes it
subscribe again from its cursor where the worker can replay (history kept between
subscriptions), else from 0. A subscription from 0 starts afresh: the real relays keep
no history and send no snapshot (live only), and a restarted engine numbers its batches
from the start again, so every from-0 subscription forgets the cursors and drops the
worker's entries (a relay that sends a snapshot rebuilds them). `OUT_OF_RANGE` to a
non-zero start means the worker cannot replay: from then on every resubscription is
from 0. `DATA_LOSS` and a broken connection start over from 0 too. A worker that answers
UNIMPLEMENTED has no KV events: the index then learns from the gateway's own placements.
A subscription waits for the worker's connection, so a restarted worker is followed
from the moment it listens. Every batch's load record refreshes the worker's load.

A worker's events are untrusted input (what a batch may hold: kv_batches.py):
- the subscription has its own channel, whose receive limit is `kv.max_event_bytes`: a
  bigger message is refused by grpc before it is decoded (the subscription then starts
  again, logged);
- a subscription that keeps failing (gaps, DATA_LOSS, too large, broken) starts again
  after an exponential backoff (capped at `kv.resubscribe_max_s`), logged once per
  episode; an episode ends after `RESET_BATCHES` batches applied in order.

The KV index sits below the fleet: this module knows a worker only as `Followed` (what it
reads and writes of one; `gateway.upstream.worker.Worker` is one) and opens the
subscription's channel with the `connect` the fleet gives it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc import aio
from smg_grpc_proto.generated import common_pb2

from gateway.config import KvConfig
from gateway.engines.base import EngineAdapter
from gateway.kv.index import KvIndex
from gateway.upstream.load.kv_batches import Followed, Gap, KvBatches, TooLarge

log = structlog.get_logger("gateway.kv")

MAX_BACKOFF_S = 8.0
FIRST_BACKOFF_S = 0.1
RESET_BATCHES = 32  # batches applied in order that end a failure episode
RESET_AFTER_S = 30.0  # or a subscription that lasted this long


class FollowState(StrEnum):
    CONNECTING = "connecting"
    FOLLOWING = "following"
    UNSUPPORTED = "unsupported"  # no KV events: placements teach the index
    RECONNECTING = "reconnecting"


# Opens the subscription's own channel to the worker, given its receive limit in bytes.
Connect = Callable[[int], aio.Channel]


class Backoff:
    """Exponential waits between subscriptions that failed; one log line per episode."""

    def __init__(self, cap_s: float) -> None:
        self.cap_s = cap_s
        self.delay = 0.0
        self.episode = False

    def fail(self) -> tuple[float, bool]:
        """The wait before the next try, and whether this failure starts an episode."""
        first = not self.episode
        self.episode = True
        delay = self.delay
        self.delay = min(self.cap_s, max(FIRST_BACKOFF_S, self.delay * 2))
        return delay, first

    def ok(self) -> None:
        self.delay = 0.0
        self.episode = False


class KvFollower(KvBatches):
    """One worker's subscription, its batches applied as they come (`KvBatches`)."""

    def __init__(
        self,
        worker: Followed,
        adapter: EngineAdapter,
        index: KvIndex,
        *,
        settings: KvConfig,
        connect: Connect,
        on_report: Callable[[], None] = lambda: None,
    ) -> None:
        """`connect` opens the subscription's own channel (receive limit
        `kv.max_event_bytes`), closed when the subscription ends: a flood of oversized
        events is refused by that channel, not by the one requests use."""
        super().__init__(worker, index, settings, on_report)
        self.state = FollowState.CONNECTING
        # by reason: gap, data_loss, out_of_range, reconnect, too_large, undecodable
        self.resyncs: dict[str, int] = {}
        self.replays = True  # resumes from a cursor (until it answers OUT_OF_RANGE)
        self._backoff = Backoff(self.settings.resubscribe_max_s)
        self._since = time.monotonic()
        self._path = adapter.path("SubscribeKvEvents")
        self._connect = connect

    # -- the subscription --------------------------------------------------------------

    def _open(self) -> aio.Channel:
        return self._connect(self.settings.max_event_bytes)

    async def run(self) -> None:
        """Follow until cancelled (or until the worker turns out to have no KV events)."""
        channel = self._open()
        try:
            await self._run(channel)
        finally:
            await channel.close()

    async def _run(self, channel: aio.Channel) -> None:
        subscribe = channel.unary_stream(
            self._path,
            request_serializer=common_pb2.SubscribeKvEventsRequest.SerializeToString,
            response_deserializer=None,  # raw bytes: decoded in pieces (apply_raw)
        )
        start = 0
        while True:
            if not start:
                self._afresh()
            try:
                await self._follow(subscribe, start)
                start, reason = 0, "ended"  # the worker ended the stream
            except Gap:
                start, reason = self._resume(), "gap"
            except (DecodeError, TooLarge) as error:
                start = self._resume()
                reason = "too_large" if isinstance(error, TooLarge) else "undecodable"
            except aio.AioRpcError as error:
                code = error.code()
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    self.state = FollowState.UNSUPPORTED
                    self.index.drop_worker(self.worker.id)
                    log.info("kv_events_unsupported", worker=self.worker.id)
                    return
                start, reason = 0, "reconnect"
                if code is grpc.StatusCode.DATA_LOSS:
                    reason = "data_loss"
                elif code is grpc.StatusCode.OUT_OF_RANGE:
                    self.replays = False  # live only: it keeps nothing to resume from
                    reason = "out_of_range"
                elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    start, reason = self._resume(), "too_large"  # over the channel's cap
                else:
                    self.state = FollowState.RECONNECTING
            await self._again(reason)

    def _resume(self) -> int:
        """Where to subscribe from after missing batches: the cursor, if the worker can
        replay from it; else 0 (and a rebuild)."""
        return min(self.cursors.values(), default=0) if self.replays else 0

    def _afresh(self) -> None:
        """A subscription from 0: what the cursors and the worker's entries say is not
        continued by it (no history, maybe a restarted engine, its sequences anew)."""
        self.cursors.clear()
        self.index.drop_worker(self.worker.id)

    async def _again(self, reason: str) -> None:
        if self._in_order >= RESET_BATCHES or time.monotonic() - self._since >= RESET_AFTER_S:
            self._backoff.ok()  # it worked for a while: a new episode
        self._in_order = 0
        if reason != "ended" and (reason != "reconnect" or self.state is FollowState.FOLLOWING):
            self.resyncs[reason] = self.resyncs.get(reason, 0) + 1
        delay, first = self._backoff.fail()
        if first:
            log.info(
                "kv_resync",
                worker=self.worker.id,
                reason=reason,
                limit_bytes=self.settings.max_event_bytes if reason == "too_large" else None,
            )
        await asyncio.sleep(delay)
        self._since = time.monotonic()

    async def _follow(self, subscribe: Any, start: int) -> None:
        request = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start, load_records_before_first_batch=True
        )
        # Waits for the connection (a restarting worker): subscribed as soon as it listens,
        # before its first batch, which a live-only relay would not send again.
        call = subscribe(request, wait_for_ready=True)
        try:
            # A live-only relay sends its headers at once and nothing until the worker's
            # next batch: following starts with the headers.
            await call.initial_metadata()
            if not call.done():
                self.state = FollowState.FOLLOWING
            async for raw in call:
                self.state = FollowState.FOLLOWING
                await self.apply_raw(raw)
        finally:
            call.cancel()
