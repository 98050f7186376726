"""Disaggregated dispatch: one client request over prefill + decode (+ encode) workers.

Two hand-off styles, named by the engine adapter (`pd_handoff`):
- "bootstrap" (SGLang): the same request, with the prefill's bootstrap host/port and a
  fresh room, goes to prefill and decode at once; they meet on the prefill's bootstrap
  port. The client gets the decode stream; the prefill stream is drained in the
  background, and its prompt logprobs are put into the first decode message.
- "kv_params" (vLLM): prefill first (one token, not streamed); its Complete's
  kv_transfer_params go into the decode request.
Encode workers (EPD) get their items concurrently, naming the prefill as receiver.
n > 1 is split into n single-sample requests, each with its own pair and room, and the
streams are merged with `index` set to the choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import structlog
from grpc import aio

from gateway.engines import EngineAdapter
from gateway.engines.encoder import ENCODE_PATH, encode_request
from gateway.engines.sglang import DEFAULT_BOOTSTRAP_PORT
from gateway.fleet.worker import Worker
from gateway.placement.placer import Assignment
from gateway.placement.verdicts import Verdict
from gateway.proxy.dispatch import RETRYABLE, CallRecord, Context, Dispatcher, refuse
from gateway.proxy.inflight import Holder, InflightTable
from gateway.proxy.metadata import Metadata, clean
from gateway.roles import Role

log = structlog.get_logger("gateway.disagg")

Sink = Callable[[bytes], Awaitable[None]]
Placer = Callable[[Collection[str]], Assignment | Verdict]

MAX_ROOM = 2**31 - 1


class LegFailure(Exception):
    """One leg of a request failed. `retryable`: before any response reached the client,
    in a way another worker may not share (no connection, UNAVAILABLE)."""

    def __init__(
        self,
        leg: Role,
        worker: Worker,
        code: grpc.StatusCode,
        details: str,
        trailers: Metadata = (),
        *,
        retryable: bool = False,
    ) -> None:
        super().__init__(f"{leg.value} worker {worker.id}: {details}")
        self.leg, self.worker, self.code = leg, worker, code
        self.details, self.trailers, self.retryable = details, trailers, retryable

    @classmethod
    def from_rpc(cls, leg: Role, worker: Worker, error: aio.AioRpcError, early: bool) -> LegFailure:
        return cls(
            leg,
            worker,
            error.code(),
            error.details() or "",
            clean(error.trailing_metadata()),
            retryable=early and error.code() in RETRYABLE,
        )


class Rooms:
    """Bootstrap rooms: random non-negative int32s, unique among requests in flight."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._busy: set[int] = set()

    def allocate(self) -> int:
        while True:
            room = self._rng.randint(0, MAX_ROOM)
            if room not in self._busy:
                self._busy.add(room)
                return room

    def release(self, room: int) -> None:
        self._busy.discard(room)

    def __len__(self) -> int:
        return len(self._busy)


@dataclass(frozen=True, slots=True)
class Job:
    """One single-sample request to run over a pair of legs."""

    context: Context
    adapter: EngineAdapter
    raw: bytes
    upstream_id: str  # the client's id, or `<id>-<i>` for choice i of n
    metadata: Metadata
    record: CallRecord
    sink: Sink  # where the decode's messages go (the client, or an n>1 merge)
    return_logprob: bool
    relay_trailers: bool  # only a lone request passes the decode's trailers on


@dataclass(eq=False)
class Leg:
    """One upstream call of one leg, with its accounting."""

    role: Role
    worker: Worker
    call: Any
    trial: bool
    holder: Holder
    code: grpc.StatusCode | None = None  # None until it ends; stays None if cancelled
    messages: list[bytes] = field(default_factory=list)
    pending_read: asyncio.Future[Any] | None = None  # a decode's first read, left running
    key: str = ""  # the client's request id, under which the holder is registered


class DisaggregatedDispatch:
    def __init__(
        self,
        dispatcher: Dispatcher,
        inflight: InflightTable,
        max_attempts: int,
        abort_wait_s: float,
    ) -> None:
        self._dispatcher = dispatcher
        self._inflight = inflight
        self._max_attempts = max_attempts
        self._abort_wait_s = abort_wait_s
        self.rooms = Rooms()
        self._background: set[asyncio.Task[None]] = set()

    async def generate(
        self,
        context: Context,
        adapter: EngineAdapter,
        raw: bytes,
        n: int,
        return_logprob: bool,
        metadata: Metadata,
        place: Placer,
        record: CallRecord,
    ) -> None:
        job = Job(
            context,
            adapter,
            raw,
            record.request_id,
            metadata,
            record,
            context.write,
            return_logprob,
            relay_trailers=True,
        )
        try:
            if n > 1:
                await self._choices(job, n, place)
            else:
                await self._attempts(job, place)
        except LegFailure as failure:
            await context.abort(failure.code, str(failure), failure.trailers)

    async def _choices(self, job: Job, n: int, place: Placer) -> None:
        """n single-sample requests `<id>-<i>`, each placed on its own pair with its own
        room; their messages merged into one stream with `index` = i. A failure of one
        choice ends the stream with its status and cancels the others."""
        lock = asyncio.Lock()
        adapter, client_id, write = job.adapter, job.upstream_id, job.context.write

        def sink_for(index: int) -> Sink:
            async def sink(message: bytes) -> None:
                retagged = adapter.retag(message, index, client_id)
                async with lock:
                    await write(retagged)

            return sink

        def choice(index: int) -> Job:
            upstream_id = f"{client_id}-{index}"
            return replace(
                job,
                raw=adapter.single_choice(job.raw, upstream_id),
                upstream_id=upstream_id,
                sink=sink_for(index),
                relay_trailers=False,
            )

        tasks = [asyncio.ensure_future(self._attempts(choice(i), place)) for i in range(n)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in done if t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _attempts(self, job: Job, place: Placer) -> None:
        """Place and run the job; a retryable leg failure before any response reached the
        client is tried again with that worker excluded."""
        tried: list[str] = []
        failure: LegFailure | None = None
        flow = self._bootstrap if job.adapter.pd_handoff == "bootstrap" else self._kv_params
        for _ in range(self._max_attempts):
            placed = place(tried)
            if isinstance(placed, Verdict):
                if failure is not None:
                    raise failure
                await refuse(job.context, job.record, placed)
            job.record.workers.extend(w.id for w in placed.all())
            try:
                await flow(job, placed)
                return
            except LegFailure as leg_failure:
                if not leg_failure.retryable:
                    raise
                failure = leg_failure
                tried.append(leg_failure.worker.id)
        assert failure is not None
        raise failure

    # -- flows -------------------------------------------------------------------------

    async def _bootstrap(self, job: Job, placed: Assignment) -> None:
        adapter, record = job.adapter, job.record
        prefill, decode = placed.workers[Role.PREFILL], placed.workers[Role.DECODE]
        room = self.rooms.allocate()
        record.rooms.append(room)
        port = prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
        request = adapter.with_bootstrap(job.raw, prefill.bootstrap_host, port, room)
        legs: list[Leg] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            timeout = job.context.time_remaining()
            p_leg = self._stream(job, Role.PREFILL, prefill, request, timeout)
            d_leg = self._stream(job, Role.DECODE, decode, request, timeout)
            legs += [p_leg, d_leg]
            tasks.append(asyncio.ensure_future(self._drain(p_leg)))
            tasks += self._encodes(job, placed, timeout, legs)
            first = await self._first_message(d_leg, tasks)
            if job.return_logprob and first is not None:
                await tasks[0]  # the prefill's answer carries the prompt logprobs
                first = adapter.with_input_logprobs(first, p_leg.messages)
            await self._relay_rest(job, d_leg, first)
        finally:
            self.rooms.release(room)
            self._finish(legs, tasks)

    async def _kv_params(self, job: Job, placed: Assignment) -> None:
        adapter = job.adapter
        prefill, decode = placed.workers[Role.PREFILL], placed.workers[Role.DECODE]
        legs: list[Leg] = []
        try:
            request = adapter.prefill_request(job.raw)
            p_leg = self._stream(job, Role.PREFILL, prefill, request, job.context.time_remaining())
            legs.append(p_leg)
            await self._drain(p_leg)
            params = adapter.kv_transfer_params(p_leg.messages)
            if params is None:
                job.record.handoff_failure = "missing_kv_params"
                raise LegFailure(
                    Role.PREFILL,
                    prefill,
                    grpc.StatusCode.INTERNAL,
                    "returned no kv_transfer_params; the decode cannot fetch the KV cache",
                )
            request = adapter.decode_request(job.raw, params)
            d_leg = self._stream(job, Role.DECODE, decode, request, job.context.time_remaining())
            legs.append(d_leg)
            first = await self._first_message(d_leg, [])
            await self._relay_rest(job, d_leg, first)
        finally:
            self._finish(legs, [])

    # -- pieces ------------------------------------------------------------------------

    def _stream(
        self, job: Job, role: Role, worker: Worker, request: bytes, timeout: float | None
    ) -> Leg:
        path = job.adapter.path("Generate")
        call = worker.channel.unary_stream(path)(request, metadata=job.metadata, timeout=timeout)
        return self._track(job, role, worker, call)

    def _track(self, job: Job, role: Role, worker: Worker, call: Any) -> Leg:
        """Count the call on its worker and make it findable by the client's request id."""
        trial = self._dispatcher.acquire(worker)
        started = asyncio.Event() if role is Role.DECODE else None
        holder = Holder(worker, job.upstream_id, started)
        key = job.record.request_id
        self._inflight.add(key, holder)
        return Leg(role, worker, call, trial, holder, key=key)

    async def _drain(self, leg: Leg) -> None:
        """Read a leg to its end (the prefill's answer); a failure names the leg."""
        try:
            async for message in leg.call:
                leg.messages.append(message)
        except aio.AioRpcError as error:
            leg.code = error.code()
            raise LegFailure.from_rpc(leg.role, leg.worker, error, early=True) from None
        leg.code = grpc.StatusCode.OK
        # Its part is done: an Abort from now on is the decode's business only.
        self._inflight.discard(leg.key, leg.holder)

    def _encodes(
        self, job: Job, placed: Assignment, timeout: float | None, legs: list[Leg]
    ) -> list[asyncio.Task[None]]:
        """Encode calls, one per encode worker with its part of the items, naming the
        worker that takes the prompt as the receiver of the embeddings."""
        receiver = placed.receiver
        port = receiver.spec.embedding_port or 0
        tasks = []
        parts = placed.encoders
        for index, (worker, items) in enumerate(parts):
            request = encode_request(
                items, job.upstream_id, len(parts), index, receiver.bootstrap_host, port
            )
            call = worker.channel.unary_unary(ENCODE_PATH)(
                request, metadata=job.metadata, timeout=timeout
            )
            leg = self._track(job, Role.ENCODE, worker, call)
            legs.append(leg)
            tasks.append(asyncio.ensure_future(self._unary_leg(leg)))
        return tasks

    async def _unary_leg(self, leg: Leg) -> None:
        try:
            leg.messages.append(await leg.call)
        except aio.AioRpcError as error:
            leg.code = error.code()
            raise LegFailure.from_rpc(leg.role, leg.worker, error, early=True) from None
        leg.code = grpc.StatusCode.OK

    async def _first_message(self, leg: Leg, others: list[asyncio.Task[None]]) -> bytes | None:
        """The decode's first message, unless another leg fails first (then that leg's
        failure is the answer: a decode waiting for a room that never comes says less).

        If the client goes away meanwhile, the read is left running for `_finish`, which
        cancels the decode only after its first message (bounded)."""
        read = asyncio.ensure_future(leg.call.read())
        watching: set[asyncio.Future[Any]] = {read, *others}
        try:
            while not read.done():
                done, _ = await asyncio.wait(watching, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not read:
                        watching.discard(task)
                        if task.exception() is not None:
                            read.cancel()  # cancels the decode call too
                            raise task.exception()  # type: ignore[misc]
        except asyncio.CancelledError:
            leg.pending_read = read
            raise
        try:
            message = read.result()
        except aio.AioRpcError as error:
            leg.code = error.code()
            raise LegFailure.from_rpc(leg.role, leg.worker, error, early=True) from None
        if leg.holder.started is not None:
            leg.holder.started.set()
        return None if message is aio.EOF else message

    async def _relay_rest(self, job: Job, leg: Leg, first: bytes | None) -> None:
        """Relay the decode's stream, starting with the (possibly amended) first message."""
        record, sink = job.record, job.sink
        if first is None:  # the decode ended without a message
            leg.code = await leg.call.code()
            if leg.code is not grpc.StatusCode.OK:
                raise LegFailure(leg.role, leg.worker, leg.code, await leg.call.details())
            return
        if record.first_message_s is None:
            record.first_message_s = time.perf_counter() - record.started
        read = leg.call.read
        message = first
        try:
            while message is not aio.EOF:
                await sink(message)
                record.messages += 1
                message = await read()
        except aio.AioRpcError as error:
            leg.code = error.code()
            raise LegFailure.from_rpc(leg.role, leg.worker, error, early=False) from None
        leg.code = grpc.StatusCode.OK
        if job.relay_trailers:
            job.context.set_trailing_metadata(clean(await leg.call.trailing_metadata()))

    def _finish(self, legs: list[Leg], tasks: list[asyncio.Task[None]]) -> None:
        """Cancel what still runs and settle each leg's accounting. A decode that has not
        sent its first message yet is cancelled only once it has (bounded), so the KV
        handoff is not torn in the middle."""
        for task in tasks:
            if not task.done():
                task.cancel()
            else:
                with contextlib.suppress(BaseException):
                    task.exception()
        for leg in legs:
            started = leg.holder.started
            if (
                started is not None
                and not started.is_set()
                and not leg.call.done()
                and (leg.pending_read is not None)
            ):
                task = asyncio.ensure_future(self._settle_after_start(leg))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                self._settle(leg)

    async def _settle_after_start(self, leg: Leg) -> None:
        read = leg.pending_read
        with contextlib.suppress(TimeoutError, asyncio.CancelledError, aio.AioRpcError):
            async with asyncio.timeout(self._abort_wait_s):
                if read is not None:
                    await read
                else:
                    await leg.call.read()
        self._settle(leg)

    def _settle(self, leg: Leg) -> None:
        if not leg.call.done():
            leg.call.cancel()
        self._inflight.discard(leg.key, leg.holder)
        self._dispatcher.release(leg.worker, leg.code, leg.trial)
