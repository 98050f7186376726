"""Upstream calls: the one way the gateway talks to a worker on a client's behalf.

Every path (regular, each leg of a disaggregated request, each choice of n>1, encoders,
fan-out, fleet-wide forwards, aborts) goes through here, so the accounting is the same
everywhere:

- a `Reservation` is taken at placement, with no await in between: the worker's in-flight
  count goes up and, if its outlier detection is half-open, this call becomes the one
  trial. A reservation is released exactly once, with the call's outcome (or none, if
  unused or cancelled by the client);
- an `UpstreamCall` owns one RPC on one reservation: it may register the call in the
  in-flight table (so an Abort finds it), relays headers, messages and trailers, turns
  every RPC error into one failure type, and on `close()` cancels what still runs,
  leaves the table and releases the reservation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc import aio

from gateway.core.roles import Role
from gateway.core.tasks import TaskScope
from gateway.observability.tracing import CallTrace, Span, end_leg
from gateway.placement.decision import Decision
from gateway.proxy.inflight import Hold, Holder, InflightTable
from gateway.proxy.metadata import Metadata, MetadataRelay, bounded_details
from gateway.upstream.registry import FleetEvent
from gateway.upstream.signals.outlier import Outcome, outcome_of
from gateway.upstream.worker import Worker

log = structlog.get_logger("gateway.upstream")

# Before the first message, these say the worker could not take the call: no connection,
# UNAVAILABLE, or CANCELLED by the worker itself (a gRPC server shutting down cancels calls
# that arrive as it stops; the client's own cancel never reaches this code as a status).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# The cause of a failure the gateway makes of a worker's answer that does not decode where
# it must be read (a continuation's, rewritten for its client): INTERNAL, the worker's.
UNDECODABLE = "undecodable"

# Failures the gateway's own channel makes before anything reaches the worker: grpc core
# refusing metadata the gateway built. They say nothing about the worker (the front
# refuses such metadata first; this keeps any that slips through out of outlier detection).
LOCAL_FAILURES = frozenset({(grpc.StatusCode.INTERNAL, "Invalid metadata")})

# An upstream DEADLINE_EXCEEDED this close to the client's own deadline (which the call
# carries) is the client's deadline: it says nothing about the worker.
CLIENT_DEADLINE_SLACK_S = 0.05


def clients_deadline(left_s: float | None) -> bool:
    """Whether a call with `left_s` of its deadline left (None: it has none) ends by the
    client's own deadline: the one rule that keeps it from being any worker's fault."""
    return left_s is not None and left_s <= CLIENT_DEADLINE_SLACK_S


class UpstreamFailure(Exception):
    """An upstream call failed: the one failure type of every path.

    `label` names the worker in the message where the client could not otherwise tell
    which of several calls failed ("decode worker HOST:PORT"); a lone forwarded call
    passes the worker's own message through unchanged.
    """

    def __init__(
        self,
        leg: Role,
        worker: Worker,
        code: grpc.StatusCode,
        details: str,
        trailers: Metadata = (),
        label: str = "",
        cause: str = "",
    ) -> None:
        self.leg, self.worker, self.code = leg, worker, code
        self.details, self.trailers, self.label = details, trailers, label
        self.cause = cause  # why, when the status alone does not say (`worker_removed`)
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.label}: {self.details}" if self.label else self.details


def retryable(failure: UpstreamFailure) -> bool:
    """Whether another worker may take the call when nothing reached the client yet: the
    worker's connection or shutdown, or an answer of its that did not decode."""
    return failure.code in RETRYABLE or failure.cause == UNDECODABLE


def label(worker: Worker) -> str:
    """How a failure names a worker when the call went to several."""
    role = "" if worker.role is Role.REGULAR else f"{worker.role.value} "
    return f"{role}worker {worker.id}"


@dataclass(frozen=True, slots=True)
class Outbound:
    """One RPC as it goes to a worker: the method, the request as that worker gets it,
    the metadata forwarded, the time left, and whether the answer streams."""

    path: str
    request: bytes
    metadata: Metadata
    timeout: float | None
    streaming: bool = False
    trace: CallTrace | None = None  # tracing on: the call's spans, for this RPC's own
    rank: int | None = None  # the data-parallel rank it runs on, if placement chose one


class Sink(Protocol):
    """Where an upstream stream's answer goes: the client, or one choice of an n>1 merge."""

    delivered: bool  # a message of this stream reached the client: no retry from here on

    async def headers(self, metadata: Metadata, *, always: bool = False) -> None: ...

    def write(self, message: bytes) -> Awaitable[None]: ...

    def trailers(self, metadata: Metadata) -> None: ...

    def prompt_cached(self, tokens: int) -> None:
        """The prompt tokens a leg that answers elsewhere (a PD prefill) found cached:
        the call's cached tokens when the answering leg does not say them."""


class Outcomes(Protocol):
    """Where upstream calls report what happened on a worker (the fleet's passive health),
    and that a reservation on it ended."""

    def released(self, worker: Worker) -> None: ...

    def on_dispatch(self, worker: Worker) -> bool: ...

    def record_outcome(self, worker: Worker, outcome: Outcome, *, trial: bool) -> None: ...


class Links(Outcomes, Protocol):
    """What upstream calls need of the fleet: each worker's channel, and where to report."""

    def method(self, worker: Worker, path: str, *, streaming: bool) -> Any: ...


class Reservation:
    """One request's slot on a worker, taken when it was placed there."""

    __slots__ = ("_judge", "_outcomes", "released", "trial", "worker")

    def __init__(self, worker: Worker, outcomes: Outcomes, *, judge: bool) -> None:
        self.worker = worker
        self._outcomes = outcomes
        self._judge = judge  # False for calls that say nothing about the worker (Abort)
        worker.reserve()
        self.trial = outcomes.on_dispatch(worker) if judge else False
        self.released = False

    def release(self, code: grpc.StatusCode | None) -> None:
        """Give the slot back; `code` None: unused, or ended by the client (no verdict)."""
        if self.released:
            return
        self.released = True
        self.worker.release()
        self._outcomes.released(self.worker)
        if self._judge:
            outcome = Outcome.IGNORED if code is None else outcome_of(code)
            try:
                self._outcomes.record_outcome(self.worker, outcome, trial=self.trial)
            except Exception:  # the fleet's trouble must not become the request's
                log.exception("record_outcome_failed", worker=self.worker.id)


@dataclass(slots=True)
class Reserved:
    """A placement with a reservation on each worker it picked."""

    decision: Decision
    slots: dict[Worker, Reservation] = field(default_factory=dict)

    def take(self, worker: Worker) -> Reservation:
        return self.slots.pop(worker)

    def release_unused(self) -> None:
        for reservation in self.slots.values():
            reservation.release(None)
        self.slots.clear()


class Upstreams:
    """Makes reservations and upstream calls; owns the settles that outlive a request."""

    def __init__(
        self,
        fleet: Links,
        inflight: InflightTable,
        abort_wait_s: float,
        relay: MetadataRelay | None = None,
    ) -> None:
        """`relay`: what of a worker's headers and trailers reaches the client."""
        self.fleet = fleet  # each worker's channel, and where outcomes are reported
        self.inflight = inflight
        self.relay = relay if relay is not None else MetadataRelay()
        self._abort_wait_s = abort_wait_s
        # The tasks of upstream calls (a decode's first read, a prefill's drain, an
        # encoder's answer, a settle waiting for a decode to start): each is cancelled by
        # its call's `close`, and whatever is left when the gateway stops, by `close`.
        # Their outcomes are their calls' business: not logged here.
        self.tasks = TaskScope(log_failures=False)
        self._live: dict[Worker, set[UpstreamCall]] = {}  # each worker's calls not settled

    def reserve(self, worker: Worker, *, judge: bool = True) -> Reservation:
        return Reservation(worker, self.fleet, judge=judge)

    def reserve_all(self, decision: Decision) -> Reserved:
        """Reserve every worker of a placement at once (call right after placing)."""
        return Reserved(decision, {w: self.reserve(w) for w in decision.all()})

    def call(
        self,
        reservation: Reservation,
        leg: Role,
        outbound: Outbound,
        *,
        label: str = "",
        hold: Hold | None = None,
        until_started: bool = False,
    ) -> UpstreamCall:
        """Start one RPC on a reservation, as the call's `leg`.

        `label` names the worker in a failure's message; `hold` registers the call for
        Abort; `until_started` (decode legs) delays its cancel until its first message,
        bounded, so a KV hand-off is not torn in the middle.
        """
        worker = reservation.worker
        timeout, metadata = outbound.timeout, outbound.metadata
        method = self.fleet.method(worker, outbound.path, streaming=outbound.streaming)
        span = None
        if outbound.trace is not None:
            span, carried = outbound.trace.leg(worker, leg, outbound.rank)
            metadata = (*metadata, *carried)
        try:
            rpc = method(outbound.request, metadata=metadata, timeout=timeout)
        except BaseException:
            reservation.release(None)
            if span is not None:
                end_leg(span, None)
            raise
        holder = None
        if hold is not None:
            started = asyncio.Event() if until_started else None
            holder = Holder(reservation.worker, hold.upstream_id, hold.principal, started)
            self.inflight.add(hold.request_id, holder)
        key = hold.request_id if hold is not None else ""
        deadline = None if timeout is None else time.monotonic() + timeout
        call = UpstreamCall(self, reservation, leg, rpc, label, key, holder, deadline, span)
        live = self._live.get(worker)
        if live is None:
            live = self._live[worker] = set()
        live.add(call)
        return call

    def evict(self, worker: Worker, cause: str) -> None:
        """The worker leaves service with calls still running (removed after its drain
        timed out): each is cut, and its failure (UNAVAILABLE, `cause`) is the request's
        to handle, as a stream's worker dying would be: tried again or continued
        elsewhere."""
        for call in self._live.pop(worker, set()):
            call.evict(cause)

    def on_fleet_event(self, event: FleetEvent) -> None:
        """A worker left the registry (removed, or dropped by discovery, after its drain):
        the calls it still has are cut, so each fails over instead of hanging."""
        if event.kind == "removed":
            self.evict(event.worker, "worker_removed")

    def settled(self, call: UpstreamCall) -> None:
        live = self._live.get(call.worker)
        if live is not None:
            live.discard(call)
            if not live:
                del self._live[call.worker]

    def ask(self, reservation: Reservation, outbound: Outbound) -> UpstreamCall:
        """A unary call to one of several workers (a fan-out target, an abort holder):
        its failure names the worker."""
        worker = reservation.worker
        return self.call(reservation, worker.role, outbound, label=label(worker))

    def defer(self, call: UpstreamCall, first: asyncio.Future[Any]) -> None:
        self.tasks.spawn(self._settle_after_start(call, first), "settle_after_start")

    async def close(self) -> None:
        """The gateway stops: every upstream call's task still running ends."""
        await self.tasks.close()

    async def _settle_after_start(self, call: UpstreamCall, first: asyncio.Future[Any]) -> None:
        try:
            async with asyncio.timeout(self._abort_wait_s):
                await first
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task's own cancel (the gateway closing): settle, then end
            # else `first` itself was cancelled: the leg ended, settle it
        except Exception:
            pass  # the leg's failure is the request's business; here it only ends the wait
        finally:
            call.settle()


class UpstreamCall:
    """One RPC to one worker, as one leg of a client call. Use as a context manager, or
    call `close()` exactly when done with it; both are idempotent."""

    def __init__(
        self,
        upstreams: Upstreams,
        reservation: Reservation,
        leg: Role,
        rpc: Any,
        label: str,
        key: str,
        holder: Holder | None,
        deadline: float | None,
        span: Span | None = None,
    ) -> None:
        self._upstreams = upstreams
        self.reservation = reservation
        self.worker = reservation.worker
        self.leg = leg
        self._rpc = rpc
        self._label = label
        self._key = key
        self._holder = holder
        self._in_table = holder is not None
        self._started = holder.started if holder is not None else None
        self.code: grpc.StatusCode | None = None  # None until it ends; stays None if cancelled
        self._first: asyncio.Future[Any] | None = None  # a decode's first read, left running
        self._drained: asyncio.Task[list[bytes]] | None = None
        self._closed = False
        self.deadline = deadline  # the client's, carried upstream (monotonic)
        # The client's own deadline ended it, or the gateway's channel refused it: not
        # the worker's doing, so it neither counts against it nor decides a trial.
        self._blameless = False
        self._span = span  # tracing on: this RPC's CLIENT span, ended as it settles
        self._evicted = ""  # why the gateway cut it (its worker left service), if it did

    def __enter__(self) -> UpstreamCall:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reading -----------------------------------------------------------------------

    def _failure(self, error: aio.AioRpcError) -> UpstreamFailure:
        trailers = self._failure_trailers(error.trailing_metadata())
        return self._ended(error.code(), error.details() or "", trailers)

    def _failure_trailers(self, metadata: Metadata | None) -> Metadata:
        return self._upstreams.relay.trailers(metadata, self.worker.id, failed=True)

    def _ended(self, code: grpc.StatusCode, details: str, trailers: Metadata) -> UpstreamFailure:
        """The call ended with a status other than OK: note it, and say whose fault. The
        worker's message, and trailers, as relayed (bounded)."""
        self.code = code
        details = bounded_details(details)
        left = None if self.deadline is None else self.deadline - time.monotonic()
        if (code is grpc.StatusCode.DEADLINE_EXCEEDED and clients_deadline(left)) or (
            code,
            details,
        ) in LOCAL_FAILURES:
            self._blameless = True
        return UpstreamFailure(self.leg, self.worker, code, details, trailers, self._label)

    async def response(self) -> bytes:
        """A unary call's answer."""
        try:
            reply: bytes = await self._rpc
        except aio.AioRpcError as error:
            raise self._failure(error) from None
        except asyncio.CancelledError:
            self._raise_if_cut()
            raise
        self.code = grpc.StatusCode.OK
        return reply

    async def headers(self) -> Metadata:
        """The worker's response headers, as relayed."""
        return self._upstreams.relay.headers(await self._rpc.initial_metadata(), self.worker.id)

    async def trailers(self) -> Metadata:
        """An OK answer's trailers, as relayed."""
        metadata = await self._rpc.trailing_metadata()
        return self._upstreams.relay.trailers(metadata, self.worker.id, failed=False)

    def drain(self) -> asyncio.Task[list[bytes]]:
        """Every message of the stream (a prefill's answer). Started once; later calls
        wait for the same reading. Once read, the call leaves the in-flight table: its
        part is done, an Abort from now on is the other legs' business."""
        if self._drained is None:
            self._drained = self._upstreams.tasks.spawn(self._drain(), "drain")
        return self._drained

    async def _drain(self) -> list[bytes]:
        messages: list[bytes] = []
        try:
            async for message in self._rpc:
                messages.append(message)
        except aio.AioRpcError as error:
            raise self._failure(error) from None
        except asyncio.CancelledError:
            self._raise_if_cut()
            raise
        self.code = grpc.StatusCode.OK
        self._leave_table()
        return messages

    async def first(self, sink: Sink, watch: Collection[asyncio.Future[Any]] = ()) -> bytes | None:
        """Relay the headers as soon as they come, then return the first message (None if
        the stream ended without one), unless a watched call fails first: that failure is
        the answer (a decode waiting for a room that never comes says less)."""
        if not watch and self._started is None:
            try:
                return await self._headers_and_first(sink)
            except aio.AioRpcError as error:
                raise self._failure(error) from None
            except asyncio.CancelledError:
                self._raise_if_cut()
                raise
        read = self._first = self._upstreams.tasks.spawn(self._headers_and_first(sink), "first")
        watching: set[asyncio.Future[Any]] = {read, *watch}
        while not read.done():
            # Cancelled here (the client left), the read stays running: `close` then
            # delays the cancel of a decode until its first message.
            done, _ = await asyncio.wait(watching, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not read:
                    watching.discard(task)
                    if task.exception() is not None:
                        read.cancel()
                        raise task.exception()  # type: ignore[misc]
        try:
            return read.result()  # type: ignore[no-any-return]
        except aio.AioRpcError as error:
            raise self._failure(error) from None
        except asyncio.CancelledError:
            self._raise_if_cut()
            raise

    async def _headers_and_first(self, sink: Sink) -> bytes | None:
        # A Trailers-Only failure also resolves the headers, empty, sometimes before the
        # call reports done; empty headers are left to go with the first message, so a
        # retry can still relay the next worker's headers.
        headers = await self.headers()
        if headers:
            await sink.headers(headers)
        message = await self._rpc.read()
        if self._started is not None:
            self._started.set()
        return None if message is aio.EOF else message

    async def relay(self, sink: Sink, first: bytes | None) -> None:
        """The relay loop: `first` (maybe amended), then the rest of the stream as raw
        bytes, then the worker's trailers."""
        rpc = self._rpc
        if first is None:  # the stream ended without a message
            code = await rpc.code()
            if code is not grpc.StatusCode.OK:
                trailers = self._failure_trailers(await rpc.trailing_metadata())
                raise self._ended(code, await rpc.details() or "", trailers)
        else:
            read, write = rpc.read, sink.write
            message = first
            try:
                while message is not aio.EOF:
                    await write(message)
                    message = await read()
            except aio.AioRpcError as error:
                raise self._failure(error) from None
            except DecodeError:  # an answer the sink must read did not: the worker's fault
                failure = self._ended(
                    grpc.StatusCode.INTERNAL,
                    f"worker {self.worker.id} sent an undecodable answer",
                    (),
                )
                failure.cause = UNDECODABLE
                raise failure from None
            except asyncio.CancelledError:
                self._raise_if_cut()
                raise
        self.code = grpc.StatusCode.OK
        sink.trailers(await self.trailers())

    def _raise_if_cut(self) -> None:
        """A read was cancelled under it: by the gateway, when its worker left service,
        that is a failure of the call (blamed on no one); else it is the client's own
        cancel, left to go on as it is."""
        task = asyncio.current_task()
        if not self._evicted or (task is not None and task.cancelling()):
            return
        self._blameless = True
        message = f"worker {self.worker.id} left service during the call ({self._evicted})"
        failure = self._ended(grpc.StatusCode.UNAVAILABLE, message, ())
        failure.cause = self._evicted
        raise failure from None

    # -- ending ------------------------------------------------------------------------

    def evict(self, cause: str) -> None:
        """Cut by the gateway: its worker leaves service (see `Upstreams.evict`)."""
        self._evicted = cause
        if not self._rpc.done():
            self._rpc.cancel()

    def close(self) -> None:
        """Cancel the RPC if it still runs, leave the in-flight table, release the
        reservation with the outcome. A decode that has not sent its first message yet
        is cancelled only once it has (bounded)."""
        if self._closed:
            return
        self._closed = True
        started, first = self._started, self.pending_first()
        if started is not None and not started.is_set() and first is not None:
            self._upstreams.defer(self, first)
        else:
            self.settle()

    def close_after(self, handed_off: asyncio.Future[Any]) -> None:
        """Close once `handed_off` is done, bounded as a decode's first message is: an
        SGLang prefill whose decode has not started yet, so the hand-off that decode waits
        for is not torn (cut there, the decode waits on a bootstrap that never comes)."""
        if self._closed:
            return
        self._closed = True
        self._upstreams.defer(self, handed_off)

    def pending_first(self) -> asyncio.Future[Any] | None:
        """The read of the first message, while it is still under way (a decode that has
        not started)."""
        first = self._first
        if first is None or first.done() or self._rpc.done():
            return None
        return first

    def settle(self) -> None:
        self._upstreams.settled(self)
        try:
            if not self._rpc.done():
                self._rpc.cancel()
            for reading in (self._first, self._drained):
                if reading is not None and not reading.done():
                    reading.cancel()
            self._leave_table()
        finally:
            self.reservation.release(None if self._blameless else self.code)
            if self._span is not None:
                end_leg(self._span, self.code.name if self.code is not None else None)
                self._span = None

    def _leave_table(self) -> None:
        if self._in_table and self._holder is not None:
            self._in_table = False
            self._upstreams.inflight.discard(self._key, self._holder)
