"""Disaggregated dispatch: one client request over prefill + decode (+ encode) workers,
each attempt's legs run by `proxy/legs.py`. n > 1 is split into n single-sample requests,
each with its own placement (and room), merged into one stream with `index` set to the
choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace

from gateway.proxy.call import Place, abort_with_failure
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.job import Job
from gateway.proxy.legs import BootstrapRooms, PairAttempt
from gateway.proxy.metadata import Metadata
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.upstream_call import Sink


class ChoiceSink:
    """Choice `index` of an n>1 request: its messages retagged as the client's and
    written one at a time; the first choice's headers are the client's; trailers stay."""

    def __init__(self, client: Sink, lock: asyncio.Lock, job: Job, index: int) -> None:
        self._client, self._lock, self._index = client, lock, index
        self._retag, self._client_id = job.adapter.retag, job.upstream_id
        self.delivered = False

    async def headers(self, metadata: Metadata, *, always: bool = False) -> None:
        await asyncio.shield(self._one_at_a_time(self._client.headers(metadata, always=always)))

    async def write(self, message: bytes) -> None:
        self.delivered = True
        retagged = self._retag(message, self._index, self._client_id)
        await asyncio.shield(self._one_at_a_time(self._client.write(retagged)))

    async def _one_at_a_time(self, operation: Awaitable[None]) -> None:
        """One operation on the client's call at a time, never cut by a cancel: a choice
        cancelled (another failed) mid-write would leave the call unable to end."""
        async with self._lock:
            await operation

    def trailers(self, metadata: Metadata) -> None:
        pass

    def prompt_cached(self, tokens: int) -> None:
        self._client.prompt_cached(tokens)  # every choice's prompt is the same


class DisaggregatedDispatch:
    def __init__(
        self,
        dispatcher: Dispatcher,
        rooms: BootstrapRooms | None = None,
        decode_first_within_s: float = 0.0,
    ) -> None:
        """`decode_first_within_s`: disagg.decode_first_message_timeout_s (0: no bound)."""
        self.dispatcher = dispatcher
        self.rooms = rooms if rooms is not None else BootstrapRooms()
        self._attempt = PairAttempt(dispatcher.upstreams, self.rooms, decode_first_within_s)

    async def serve(
        self, job: Job, n: int, place: Place, placed_ahead: ReservedPlacement | None = None
    ) -> None:
        """`placed_ahead` (n = 1 only): the placement a waiting room made and reserved."""
        if n == 1:  # the regular attempt loop, each attempt on a pair
            await self.dispatcher.serve(job, place, self._attempt, placed_ahead)
            return
        try:
            await self._choices(job, n, place)
        except UpstreamFailure as failure:
            await abort_with_failure(job.context, failure)

    async def _choices(self, job: Job, n: int, place: Place) -> None:
        """n single-sample requests `<id>-<i>`, each placed on its own pair with its own
        room; their messages merged into one stream with `index` = i. A failure of one
        choice ends the stream with its status and cancels the others."""
        lock = asyncio.Lock()

        def choice(index: int) -> Job:
            upstream_id = f"{job.upstream_id}-{index}"
            return replace(
                job,
                raw=job.adapter.single_choice(job.raw, upstream_id),
                upstream_id=upstream_id,
                sink=ChoiceSink(job.sink, lock, job, index),
                choices=1,
            )

        run = self.dispatcher.run
        try:
            async with asyncio.TaskGroup() as choices:  # one fails: the others are cancelled
                for i in range(n):
                    choices.create_task(run(choice(i), place, self._attempt))
        except BaseExceptionGroup as failed:  # the first failure is the stream's status
            raise failed.exceptions[0] from None
        finally:
            async with lock:  # a write in flight on the client's call ends before its status
                pass
