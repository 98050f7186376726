"""One upstream RPC on one reservation, as one leg of a client call (`UpstreamCall`).

Its own module because it is the relay itself: `Upstreams` (`proxy/upstream.py`) makes
the call; from there the call registers in the in-flight table (so an Abort finds it),
relays headers, messages and trailers to a `Sink`, turns every RPC error into one
`UpstreamFailure`, and on `close()` cancels what still runs, leaves the table and
releases its reservation with the outcome.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Collection
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from gateway.core.roles import Role
from gateway.core.tasks import TaskScope
from gateway.observability.tracing import Span, end_leg
from gateway.proxy.failures import LOCAL_FAILURES, UNDECODABLE, UpstreamFailure, clients_deadline
from gateway.proxy.inflight import InflightCall, InflightTable
from gateway.proxy.metadata import Metadata, MetadataRelay, bounded_details
from gateway.proxy.reservation import Reservation


class Sink(Protocol):
    """Where an upstream stream's answer goes: the client, or one choice of an n>1 merge."""

    delivered: bool  # a message of this stream reached the client: no retry from here on

    async def headers(self, metadata: Metadata, *, always: bool = False) -> None: ...

    def write(self, message: bytes) -> Awaitable[None]: ...

    def trailers(self, metadata: Metadata) -> None: ...

    def prompt_cached(self, tokens: int) -> None:
        """The prompt tokens a leg that answers elsewhere (a PD prefill) found cached:
        the call's cached tokens when the answering leg does not say them."""


class Owner(Protocol):
    """What an upstream call uses of the `Upstreams` that made it: the relay of headers
    and trailers, the in-flight table, the tasks of its reads, and where it settles."""

    relay: MetadataRelay
    inflight: InflightTable
    tasks: TaskScope

    def defer(self, call: UpstreamCall, first: asyncio.Future[Any]) -> None: ...

    def settled(self, call: UpstreamCall) -> None: ...


class UpstreamCall:
    """One RPC to one worker, as one leg of a client call. Use as a context manager, or
    call `close()` exactly when done with it; both are idempotent."""

    def __init__(
        self,
        upstreams: Owner,
        reservation: Reservation,
        leg: Role,
        rpc: Any,
        label: str,
        key: str,
        holder: InflightCall | None,
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

    async def settle_after(self, first: asyncio.Future[Any], wait_s: float) -> None:
        """Settle once `first` is done, waiting `wait_s` at most (see `close`)."""
        try:
            async with asyncio.timeout(wait_s):
                await first
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task's own cancel (the gateway closing): settle, then end
            # else `first` itself was cancelled: the leg ended, settle it
        except Exception:
            pass  # the leg's failure is the request's business; here it only ends the wait
        finally:
            self.settle()

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
