"""Dispatch: the one attempt loop, and the flows it runs on a placement.

Placement and reservation happen in one step (nothing awaits in between), so the next
request's placement already sees this one on every worker it picked. Before the client
has seen a response message, a retryable upstream failure (no connection, UNAVAILABLE,
the worker's own CANCELLED) is tried again on a placement without that worker; any other
status, and any failure after the first message, reaches the client as it is, with the
worker's trailing metadata. The client's remaining deadline goes on every upstream call;
a client cancel cancels them all at once (each call's `close`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import NoReturn

import structlog

from gateway.engines import EngineAdapter
from gateway.engines.base import Tally
from gateway.observability.logs import Throttle
from gateway.observability.record import CallRecord
from gateway.placement.decision import Decision
from gateway.placement.verdicts import Verdict
from gateway.proxy.call import Call, Context
from gateway.proxy.inflight import Hold
from gateway.proxy.metadata import Metadata
from gateway.proxy.status import abort_with_verdict
from gateway.proxy.upstream import (
    RETRYABLE,
    Outbound,
    Reserved,
    Sink,
    UpstreamCall,
    UpstreamFailure,
    Upstreams,
)
from gateway.upstream.worker import Worker

Place = Callable[[Collection[str]], Decision | Verdict]

log = structlog.get_logger("gateway.proxy")
USAGE_LINES = Throttle(1.0, 5)  # worker_usage_rejected lines: a worker may cause one a call


async def refuse(context: Context, record: CallRecord, verdict: Verdict) -> NoReturn:
    """Answer with a placement verdict (Trailers-Only), noting it for logs and metrics."""
    record.verdict = verdict
    await abort_with_verdict(context, verdict)


async def answer(context: Context, failure: UpstreamFailure) -> NoReturn:
    """End the client's call with an upstream failure's status and trailers."""
    await context.abort(failure.code, failure.message, failure.trailers)
    raise AssertionError("unreachable: abort raises")


class Downstream:
    """The client's side of a call: headers go out at most once, messages are counted."""

    __slots__ = (
        "_context",
        "_every",
        "_headers_sent",
        "_last",
        "_record",
        "_tally",
        "delivered",
    )

    def __init__(
        self,
        context: Context,
        record: CallRecord,
        tally: Tally | None = None,
    ) -> None:
        """`tally` (Generate) sees the answers and goes into the record as the call ends.
        Running totals of one choice need its last message only (read as the call ends:
        nothing parsed per message); deltas, or several choices interleaved, need every
        message read."""
        self._context = context
        self._record = record
        self._tally = tally
        # The tally that reads every message (None: the last one only, or no tally).
        self._every = tally if tally is not None and not tally.last_only else None
        self._last: bytes | None = None
        self._headers_sent = False
        self.delivered = False

    async def headers(self, metadata: Metadata, *, always: bool = False) -> None:
        if self._headers_sent or not (metadata or always):
            return
        self._headers_sent = True
        await self._context.send_initial_metadata(metadata)

    async def write(self, message: bytes) -> None:
        record = self._record
        if not self.delivered:
            self.delivered = True
            record.first_message_s = time.perf_counter() - record.started
        record.messages += 1
        if self._every is not None:
            self._every.see(message)
        else:
            self._last = message
        await self._context.write(message)

    def tally(self) -> None:
        """The call ended: what the engine reported goes into the record."""
        last, self._last, tally = self._last, None, self._tally
        if tally is None:
            return
        if last is not None:
            tally.see(last)
        if tally.seen:
            record = self._record
            record.completion_tokens = tally.completion_tokens
            record.cached_tokens = tally.cached_tokens
            record.usage_rejected = tally.rejected
            if record.usage_rejected:
                _usage_rejected(record)

    def trailers(self, metadata: Metadata) -> None:
        self._context.set_trailing_metadata(metadata)


def _usage_rejected(record: CallRecord) -> None:
    """A worker reported more than the call could have used: counted as the bound (it
    settles the tenant's budget), logged at a bounded rate (a worker may do it every call)."""
    held = USAGE_LINES.take()
    if held is not None:
        log.warning(
            "worker_usage_rejected",
            worker=record.worker,
            model=record.model,
            figures=list(record.usage_rejected),
            counted_completion_tokens=record.completion_tokens,
            counted_cached_tokens=record.cached_tokens,
            suppressed=held,
        )


@dataclass(frozen=True, slots=True)
class Job:
    """One client call, or one choice of an n>1 call, to place and run: the call, and
    what this part of it sends (its own request bytes and id) and where its answer goes."""

    call: Call
    adapter: EngineAdapter
    raw: bytes
    sink: Sink
    upstream_id: str  # the id the workers know it by: the client's, or `<id>-<i>`
    return_logprob: bool = False

    @property
    def context(self) -> Context:
        return self.call.context

    @property
    def record(self) -> CallRecord:
        return self.call.record

    def outbound(
        self, request: bytes, *, streaming: bool, path: str | None = None, rank: int | None = None
    ) -> Outbound:
        """`request` as an RPC to a worker: the call's method (or `path`), its forwarded
        metadata and the client's time left (`rank`: the data-parallel rank it runs on)."""
        call = self.call
        return Outbound(
            path or call.spec.path,
            request,
            call.meta.forward,
            call.context.time_remaining(),
            streaming,
            call.trace,
            rank,
        )

    def for_worker(self, request: bytes, decision: Decision, worker: Worker) -> bytes:
        """The request as `worker` gets it: on the data-parallel rank placement chose."""
        rank = decision.rank_of(worker)
        return request if rank is None else self.adapter.with_dp_rank(request, rank)

    def hold(self) -> Hold:
        record = self.call.record
        return Hold(record.request_id, self.upstream_id, record.principal)


Flow = Callable[[Job, Reserved], Awaitable[bytes | None]]


class Dispatcher:
    def __init__(self, upstreams: Upstreams, max_attempts: int) -> None:
        self.upstreams = upstreams
        self._max_attempts = max_attempts

    async def serve(
        self, job: Job, place: Place, flow: Flow, first: Reserved | None = None
    ) -> bytes | None:
        """Run the job; an upstream failure becomes the client's status."""
        try:
            return await self.run(job, place, flow, first)
        except UpstreamFailure as failure:
            await answer(job.context, failure)

    async def run(
        self, job: Job, place: Place, flow: Flow, first: Reserved | None = None
    ) -> bytes | None:
        """The attempt loop: place and reserve, run the flow; a retryable failure before
        anything reached the client is tried again without the worker that failed.
        `first`: the first attempt's placement, made and reserved already (by a waiting
        room, as capacity came free)."""
        record = job.record
        tried: list[str] = []
        failure: UpstreamFailure | None = None
        for _ in range(self._max_attempts):
            if first is not None:
                reserved, first = first, None
            else:
                started_ns = time.time_ns()
                placed = place(tried)
                if job.call.trace is not None:
                    job.call.trace.placement(started_ns, placed, tried)
                if isinstance(placed, Verdict):
                    if failure is None:
                        await refuse(job.context, record, placed)
                    break  # nobody else to try: the last worker's own failure is the answer
                reserved = self.upstreams.reserve_all(placed)
            placed = reserved.decision
            job.call.placements.append(reserved)
            record.attempts += 1
            if placed.expected_cached_tokens is not None:
                record.expected_cached_tokens = placed.expected_cached_tokens
            if failure is not None:
                record.retries += 1
            try:
                return await flow(job, reserved)
            except UpstreamFailure as error:
                if error.code not in RETRYABLE or job.sink.delivered:
                    raise
                failure = error
                tried.append(error.worker.id)
            finally:
                reserved.release_unused()
        assert failure is not None
        raise failure

    # -- regular flows: one worker answers the whole call ------------------------------

    def flow(self, streaming: bool) -> Flow:
        """The regular flow for an RPC of this shape."""
        return self.stream if streaming else self.unary

    async def stream(self, job: Job, reserved: Reserved) -> None:
        with self._lone_call(job, reserved, streaming=True) as call:
            await call.relay(job.sink, await call.first(job.sink))

    async def unary(self, job: Job, reserved: Reserved) -> bytes:
        with self._lone_call(job, reserved, streaming=False) as call:
            reply = await call.response()
            await job.sink.headers(await call.headers(), always=True)
            job.sink.trailers(await call.trailers())
            return reply

    def _lone_call(self, job: Job, reserved: Reserved, *, streaming: bool) -> UpstreamCall:
        worker = reserved.decision.lone
        job.record.called(worker.role, worker.id)
        job.record.worker = worker.id
        request = job.for_worker(job.raw, reserved.decision, worker)
        return self.upstreams.call(
            reserved.take(worker),
            worker.role,
            job.outbound(request, streaming=streaming, rank=reserved.decision.rank_of(worker)),
            hold=job.hold() if streaming else None,
        )
