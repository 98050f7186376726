"""Dispatch: send one call to a placed worker, retry before the first message, relay.

Before the client has seen a response message, a retryable upstream failure (no
connection, UNAVAILABLE) is tried again on a different worker; any other status, and
any failure after the first message, reaches the client unchanged with the worker's
trailing metadata. The client's remaining deadline goes on every upstream call, and a
client cancel cancels the upstream call at once (the `finally` below).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import NoReturn, Protocol, TypeAlias

import grpc
from grpc import aio

from gateway.fleet.breaker import Outcome, outcome_of
from gateway.fleet.worker import Worker
from gateway.placement.verdicts import Verdict
from gateway.proxy.inflight import Holder, InflightTable
from gateway.proxy.metadata import Metadata, clean
from gateway.proxy.status import abort_with_verdict

Context: TypeAlias = aio.ServicerContext  # grpc ships no type hints: Any to mypy
Picker = Callable[[Collection[str]], Worker | Verdict]

# Before the first message, these say the worker could not take the call: no connection,
# UNAVAILABLE, or CANCELLED by the worker itself (a gRPC server shutting down cancels calls
# that arrive as it stops; the client's own cancel never reaches this code as a status).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


@dataclass(slots=True)
class CallRecord:
    """What the per-request log line and metrics report once a call has finished."""

    rpc: str
    service: str
    model: str = ""
    request_id: str = ""
    workers: list[str] = field(default_factory=list)
    code: str = "OK"
    started: float = field(default_factory=time.perf_counter)
    first_message_s: float | None = None
    messages: int = 0
    headers_sent: bool = False  # once sent, a retry on another worker must not resend them
    verdict: Verdict | None = None  # the placement verdict the call was refused with
    legs: str = "regular"
    rooms: list[int] = field(default_factory=list)  # SGLang PD bootstrap rooms, per choice
    handoff_failure: str = ""  # why a PD hand-off failed, for metrics (missing_kv_params)


async def refuse(context: Context, record: CallRecord, verdict: Verdict) -> NoReturn:
    """Answer with a placement verdict (Trailers-Only), noting it for logs and metrics."""
    record.verdict = verdict
    await abort_with_verdict(context, verdict)


class _RetryElsewhere(Exception):
    """The upstream failed before any response reached the client, in a retryable way."""

    def __init__(self, error: aio.AioRpcError) -> None:
        self.error = error


async def _pass_through(context: Context, error: aio.AioRpcError) -> None:
    await context.abort(error.code(), error.details() or "", clean(error.trailing_metadata()))


class Outcomes(Protocol):
    """Where dispatch reports what happened on a worker (the fleet's passive health)."""

    def on_dispatch(self, worker: Worker) -> bool: ...

    def record_outcome(self, worker: Worker, outcome: Outcome, *, trial: bool) -> None: ...


class Dispatcher:
    def __init__(self, outcomes: Outcomes, inflight: InflightTable, max_attempts: int) -> None:
        self._outcomes = outcomes
        self._inflight = inflight
        self._max_attempts = max_attempts

    def acquire(self, worker: Worker) -> bool:
        """Count the request on the worker; True if it is the breaker's half-open trial."""
        worker.inflight += 1
        return self._outcomes.on_dispatch(worker)

    def release(self, worker: Worker, code: grpc.StatusCode | None, trial: bool) -> None:
        worker.release()
        outcome = Outcome.IGNORED if code is None else outcome_of(code)
        self._outcomes.record_outcome(worker, outcome, trial=trial)

    async def forward(
        self,
        context: Context,
        path: str,
        request: bytes,
        metadata: Metadata,
        pick: Picker,
        record: CallRecord,
        *,
        streaming: bool,
    ) -> bytes | None:
        """Place, call and relay with retries; returns the unary answer (None for streams)."""
        tried: list[str] = []
        failure: aio.AioRpcError | None = None
        for _ in range(self._max_attempts):
            placement = pick(tried)
            if isinstance(placement, Verdict):
                if failure is None:
                    await refuse(context, record, placement)
                break  # nobody else to try: the last worker's own failure is the answer
            tried.append(placement.id)
            record.workers.append(placement.id)
            try:
                if streaming:
                    await self._relay(context, placement, path, request, metadata, record)
                    return None
                return await self._unary(context, placement, path, request, metadata)
            except _RetryElsewhere as retry:
                failure = retry.error
        assert failure is not None
        await _pass_through(context, failure)
        return None

    async def _relay(
        self,
        context: Context,
        worker: Worker,
        path: str,
        request: bytes,
        metadata: Metadata,
        record: CallRecord,
    ) -> None:
        call = worker.channel.unary_stream(path)(
            request, metadata=metadata, timeout=context.time_remaining()
        )
        trial = self.acquire(worker)
        holder = Holder(worker, record.request_id)
        self._inflight.add(record.request_id, holder)
        code: grpc.StatusCode | None = None  # None: ended by the client (cancel)
        try:
            # A Trailers-Only failure also resolves initial_metadata, empty, sometimes before
            # the call reports done; empty headers are left to go with the first message, so
            # a retry can still relay the next worker's headers.
            headers = clean(await call.initial_metadata())
            if headers and not record.headers_sent:
                record.headers_sent = True
                await context.send_initial_metadata(headers)
            read, write = call.read, context.write
            try:
                message = await read()
                if message is not aio.EOF:
                    record.first_message_s = time.perf_counter() - record.started
                    while message is not aio.EOF:
                        await write(message)
                        record.messages += 1
                        message = await read()
            except aio.AioRpcError as error:
                code = error.code()
                if record.first_message_s is None and code in RETRYABLE:
                    raise _RetryElsewhere(error) from None
                await _pass_through(context, error)
            code = grpc.StatusCode.OK
            context.set_trailing_metadata(clean(await call.trailing_metadata()))
        finally:
            self.release(worker, code, trial)
            self._inflight.discard(record.request_id, holder)
            if not call.done():
                call.cancel()

    async def _unary(
        self,
        context: Context,
        worker: Worker,
        path: str,
        request: bytes,
        metadata: Metadata,
    ) -> bytes:
        call = worker.channel.unary_unary(path)(
            request, metadata=metadata, timeout=context.time_remaining()
        )
        trial = self.acquire(worker)
        code: grpc.StatusCode | None = None
        try:
            try:
                reply: bytes = await call
            except aio.AioRpcError as error:
                code = error.code()
                if code in RETRYABLE:
                    raise _RetryElsewhere(error) from None
                await _pass_through(context, error)
                raise
            code = grpc.StatusCode.OK
            await context.send_initial_metadata(clean(await call.initial_metadata()))
            context.set_trailing_metadata(clean(await call.trailing_metadata()))
            return reply
        finally:
            self.release(worker, code, trial)
            if not call.done():
                call.cancel()
