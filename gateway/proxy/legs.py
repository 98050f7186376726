"""One disaggregated attempt: a client request's legs on the prefill + decode (+ encode)
workers placement reserved for it.

The order of the legs is the engine's business (its adapter's `handoff`, which drives
`PlacedLegs`); what happens here is the same for every engine: each leg is an upstream
call on the reservation placement took for it, encoders get their items concurrently
naming the prefill as receiver, the decode's stream is relayed to the client, and when the
attempt ends every leg is closed and its bootstrap rooms are free again.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc

from gateway.core.roles import Role
from gateway.engines.encoder import ENCODE_PATH, encode_request
from gateway.engines.handoff import AmendFirst
from gateway.proxy.failures import UpstreamFailure, label
from gateway.proxy.job import Job
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.upstream import Upstreams
from gateway.proxy.upstream_call import UpstreamCall
from gateway.upstream.worker import Worker

MAX_ROOM = 2**31 - 1
# The hand-off failure of a decode leg given up for want of a first message.
DECODE_STALLED = "decode_stalled"


class BootstrapRooms:
    """Bootstrap rooms: random non-negative int32s, unique among requests in flight. With
    several serving processes, process `index` of `count` takes only rooms congruent to
    its index modulo the count, so rooms are unique across processes too."""

    def __init__(self, rng: random.Random | None = None, index: int = 0, count: int = 1) -> None:
        self._rng = rng or random.Random()
        self._busy: set[int] = set()
        self._index, self._count = index, count
        self._top = (MAX_ROOM - index) // count

    def allocate(self) -> int:
        while True:
            room = self._rng.randint(0, self._top) * self._count + self._index
            if room not in self._busy:
                self._busy.add(room)
                return room

    def release(self, room: int) -> None:
        self._busy.discard(room)

    def __len__(self) -> int:
        return len(self._busy)


class PlacedLegs:
    """One attempt's legs on its reserved workers: what an engine's hand-off drives
    (`PlacedPair`), plus the encoders. `close` ends every leg, however the attempt ended."""

    def __init__(
        self,
        upstreams: Upstreams,
        rooms: BootstrapRooms,
        job: Job,
        reserved: ReservedPlacement,
        first_within_s: float = 0.0,
    ) -> None:
        self._upstreams = upstreams
        self._first_within_s = first_within_s
        self._rooms = rooms
        self._job, self._reserved = job, reserved
        workers = reserved.decision.workers
        self._prefill, self._decode = workers[Role.PREFILL], workers[Role.DECODE]
        self.raw, self.return_logprob = job.raw, job.return_logprob
        self.prefill_host = self._prefill.bootstrap_host
        self.prefill_bootstrap_port = self._prefill.bootstrap_port
        self._calls: list[UpstreamCall] = []
        self._watch: list[asyncio.Future[Any]] = []  # legs whose failure is the answer
        self._taken_rooms: list[int] = []
        self._beside: UpstreamCall | None = None  # a prefill running beside its decode
        self._decode_call: UpstreamCall | None = None

    def new_room(self) -> int:
        room = self._rooms.allocate()
        self._taken_rooms.append(room)
        self._job.call.room(room)
        return room

    def prefill(self, request: bytes, *, background: bool) -> UpstreamCall:
        request = self._job.for_worker(request, self._reserved.decision, self._prefill)
        call = self._open(Role.PREFILL, self._prefill, request)
        if background:
            self._beside = call
            self._watch.append(call.drain())
        return call

    async def decode(self, request: bytes, amend_first: AmendFirst | None = None) -> None:
        call = self._decode_call = self._open(Role.DECODE, self._decode, request)
        sink = self._job.sink
        try:
            async with asyncio.timeout(self._first_within_s or None):
                first = await call.first(sink, self._watch)
        except TimeoutError:
            raise self._stalled() from None
        if first is not None and amend_first is not None:
            first = await amend_first(first)
        await call.relay(sink, first)

    def prompt_cached(self, tokens: int) -> None:
        self._job.sink.prompt_cached(tokens)

    def prefill_failed(self, reason: str, details: str) -> UpstreamFailure:
        self._job.call.handoff_failed(reason)
        prefill = self._prefill
        return UpstreamFailure(
            Role.PREFILL, prefill, grpc.StatusCode.INTERNAL, details, (), label(prefill)
        )

    def _stalled(self) -> UpstreamFailure:
        """The decode sent nothing within the bound: the attempt is given up (its legs
        closed as a cancel closes them) and, before any byte reached the client, tried
        again without that decode (on the CPU, a pair whose transfer stalled stalled its
        next ones too, until the prefill's KV lease ran out). Its status is the worker's
        to neither side: the code is the gateway's, no outlier strike."""
        self._job.call.handoff_failed(DECODE_STALLED)
        decode, within = self._decode, self._first_within_s
        details = f"no first message within {within:g} s (disagg.decode_first_message_timeout_s)"
        return UpstreamFailure(
            Role.DECODE,
            decode,
            grpc.StatusCode.UNAVAILABLE,
            details,
            (),
            label(decode),
        )

    def encode(self) -> None:
        """Each encoder its part of the items, naming the worker that takes the prompt as
        the receiver of the embeddings; concurrently with the other legs."""
        job, assignment = self._job, self._reserved.decision
        receiver = assignment.receiver
        parts = assignment.encoders
        for index, (worker, items) in enumerate(parts):
            request = encode_request(
                items,
                job.upstream_id,
                len(parts),
                index,
                receiver.bootstrap_host,
                receiver.spec.embedding_port or 0,
            )
            call = self._open(Role.ENCODE, worker, request, path=ENCODE_PATH, streaming=False)
            self._watch.append(self._upstreams.tasks.spawn(call.response(), "encode"))

    def _open(
        self,
        leg: Role,
        worker: Worker,
        request: bytes,
        *,
        path: str | None = None,
        streaming: bool = True,
    ) -> UpstreamCall:
        call = self._job.open_leg(
            self._upstreams,
            self._reserved,
            worker,
            leg,
            request,
            streaming=streaming,
            path=path,
            label=label(worker),
            answers=leg is Role.DECODE,
            until_started=leg is Role.DECODE,
        )
        self._calls.append(call)
        return call

    def close(self) -> None:
        """Every leg ended. A decode that has not started is cut only once it has (see
        `UpstreamCall.close`), and a prefill running beside it only then too: the hand-off
        between them goes on to its end rather than leave the decode waiting for it."""
        decode = self._decode_call
        handing_off = decode.pending_first() if decode is not None else None
        beside = self._beside if handing_off is not None else None
        for task in self._watch:
            if beside is not None and task is beside.drain():
                continue  # read on until the hand-off is done
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: a leg's late failure is no one's answer
        for call in self._calls:
            if call is beside and handing_off is not None:
                call.close_after(handing_off)
            else:
                call.close()
        for room in self._taken_rooms:
            self._rooms.release(room)


class PairAttempt:
    """The attempt the attempt loop runs on each placement of a disaggregated call: its
    legs opened on the reserved workers, driven by the engine's hand-off, all closed."""

    def __init__(
        self, upstreams: Upstreams, rooms: BootstrapRooms, first_within_s: float = 0.0
    ) -> None:
        self._upstreams, self._rooms = upstreams, rooms
        self._first_within_s = first_within_s

    async def __call__(self, job: Job, reserved: ReservedPlacement) -> None:
        legs = PlacedLegs(self._upstreams, self._rooms, job, reserved, self._first_within_s)
        try:
            legs.encode()
            await job.adapter.handoff.run(legs)
        finally:
            legs.close()
