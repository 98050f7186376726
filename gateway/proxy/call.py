"""One client call at the front, as one object: what it asks (the method, its metadata
read once), who sent it, its record for the log and metrics, its request once read, its
client side (`Downstream`), each placement made for it with its reservations, and its
ending.

Created when the stream opens; every stage of the pipeline (`proxy/stages.py`) and the
handler of every other RPC kind take it whole, so a piece of the call is read in one
place and passed on, never fetched again from grpc. The record is written through the
call's methods (and its client side's), nowhere else: the stages, dispatch and the legs
say what happened, the call notes it. What a stage takes that must go back (an
admission slot, a tenant's budget, a reservation) is registered on the call's ending,
which gives it back once, in the reverse order, however the call ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import NoReturn, Protocol

import grpc
import structlog

from gateway.core.roles import Role
from gateway.core.slo import Slo
from gateway.core.verdicts import Verdict
from gateway.engines import GenerateInfo, RpcSpec
from gateway.engines.usage import Tally
from gateway.kv.prefix import Prefix
from gateway.observability.logs import Throttle
from gateway.observability.record import CallRecord
from gateway.observability.tracing import CallTrace
from gateway.placement.decision import Decision
from gateway.placement.policies import Hints
from gateway.proxy.backlog import PrefillHold
from gateway.proxy.context import Context, LoadTrailed
from gateway.proxy.failures import UpstreamFailure, clients_deadline
from gateway.proxy.metadata import Metadata, RequestMeta
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.status import abort_with_verdict

Place = Callable[[Collection[str]], Decision | Verdict]  # an attempt's placement, given who failed

log = structlog.get_logger("gateway.proxy")
USAGE_LINES = Throttle(1.0, 5)  # worker_usage_rejected lines: a worker may cause one a call
NO_HINTS = Hints()  # a call that names no hints (a frozen value, shared)


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
        "on_first",
    )

    def __init__(self, context: Context, record: CallRecord, tally: Tally | None = None) -> None:
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
        self.on_first: Callable[[], None] | None = None  # told of the first message

    async def headers(self, metadata: Metadata, *, always: bool = False) -> None:
        if self._headers_sent or not (metadata or always):
            return
        self._headers_sent = True
        await self._context.send_initial_metadata(metadata)

    def write(self, message: bytes) -> Awaitable[None]:
        """Noted, then written: grpc's own awaitable is returned as it is, so relaying a
        message makes no coroutine of its own here (this runs once per message)."""
        record = self._record
        if not self.delivered:
            self.delivered = True
            record.first_message_s = time.perf_counter() - record.started
            if self.on_first is not None:
                self.on_first()
        record.messages += 1
        if self._every is not None:
            self._every.see(message)
        else:
            self._last = message
        return self._context.write(message)

    @property
    def reading(self) -> str | None:
        """Which messages its usage is read from: `last`, `all`, or None (not a Generate)."""
        return None if self._tally is None else "last" if self._every is None else "all"

    def relayed(self, message: bytes | None) -> None:
        """A message Envoy relayed (picker mode), read for usage as `write` reads it. None:
        one stepped over unread: the usage is unknown, unless a later one says all."""
        if self._every is None:
            self._last = message
        elif message is None:
            self._every = self._tally = None
        else:
            self._every.see(message)

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

    def prompt_cached(self, tokens: int) -> None:
        if self._tally is not None:
            self._tally.prompt_cached(tokens)


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


class Teller(Protocol):
    """Who tells of a call as it ends (gateway.proxy.call_log's `CallLog`)."""

    def ended(self, call: Call) -> None: ...


@dataclass(slots=True)
class Call:
    spec: RpcSpec
    context: Context
    record: CallRecord  # record.principal: who sent it (mTLS identity or API key name)
    meta: RequestMeta
    caller: str  # whose admission share it takes: the principal, else `peer:<address>`
    request: bytes = b""  # the request message, once read
    # Every placement, in order (a retry's, each choice's of n>1), with its reservations:
    # added by `placed` as dispatch places.
    placements: list[ReservedPlacement] = field(default_factory=list)
    trace: CallTrace | None = None  # tracing on: its spans (the front starts and ends them)
    # What the stages learn on the way, for the ones after them (Generate and Embed).
    info: GenerateInfo | None = None  # Generate: the fields routing reads (`decode`)
    highest_token: int = -1  # its prompt's largest token id, if it has one (`decode`)
    model: str = ""  # the model it is for, resolved (`resolve`)
    tenant: str = "default"  # whose budget and queue share (`classify`)
    klass: int = 0  # its class with flow control (`classify`)
    cost: int = 0  # tokens: the prompt and what its choices may generate (`classify`)
    hints: Hints = NO_HINTS  # where it wants to go, prompt included (a value: shared)
    legs: tuple[Role, ...] = ()  # the legs its model needs (`wait`)
    place: Place | None = None  # how each attempt is placed (`wait`)
    placed_ahead: ReservedPlacement | None = None  # placed by a waiting room (`wait`)
    reply: bytes | None = None  # a unary call's answer (`dispatch`)
    downstream: Downstream | None = None  # the client side, once dispatch starts
    orca: LoadTrailed | None = None  # ORCA trailers on: the context that adds the report
    hold: PrefillHold | None = None  # its tokens in its worker's prefill backlog
    call_log: Teller | None = None  # its door's (`CallLog`): metrics, trace, log as it ends
    ending: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # `on_end`'s
    told: bool = False  # its status came from whoever answered the client (`ended_with`)
    handed: bool = False  # sent whole to the relay, which tells of it (`handed_over`)

    # -- the record, written here only ----------------------------------------------

    async def refuse(self, verdict: Verdict) -> NoReturn:
        """Answer with a placement verdict (Trailers-Only), noting it for logs and metrics."""
        self.record.verdict = verdict
        await abort_with_verdict(self.context, verdict)

    def entered(self, stage: str) -> None:
        """It is in `stage` of the pipeline now (or its handler's, an RPC kind's name)."""
        self.record.stage = stage

    def came_from(self, peer: str) -> None:
        """The client's address, noted before anything can refuse the call."""
        self.record.peer = peer

    def opened(self, meta: RequestMeta, principal: str | None, caller: str) -> None:
        """Its metadata read, and who it is (`open`)."""
        self.meta, self.caller, self.record.principal = meta, caller, principal

    def decoded(
        self, prompt_tokens: int, info: GenerateInfo | None = None, highest_token: int = -1
    ) -> None:
        """What routing reads of its request (`decode`): Generate's fields, the prompt
        among its hints for cache-aware placement, its largest token id."""
        self.record.prompt_tokens = prompt_tokens
        self.highest_token = info.highest_token if info is not None else highest_token
        self.hints = self.meta.hints
        if info is not None:
            self.info, self.record.request_id = info, info.request_id
            self.record.choices = info.n
            self.hints = replace(self.hints, prefix=Prefix(info.tokens, info.namespace))

    def aimed(self, slo: Slo, klass: str) -> None:
        """Its latency objectives, for placement and for the metrics of their attainment
        (`klass`: its class as those name it)."""
        self.hints = replace(self.hints, slo=slo)
        self.record.slo, self.record.slo_class = slo, klass

    def named(self, request_ids: str) -> None:
        """The request ids it names (an Abort)."""
        self.record.request_id = request_ids

    def classified(
        self,
        tenant: str,
        cost: int,
        klass: int = 0,
        *,
        shown: bool = False,
        priority: str | None = None,
        lowered: bool = False,
    ) -> None:
        """Whose budget and share, its cost in tokens, its class with flow control;
        `shown`: the record names the tenant (flow control or rate limits are on)."""
        self.tenant, self.cost, self.klass = tenant, cost, klass
        record = self.record
        if shown:
            record.tenant = tenant
        record.priority, record.lowered = priority, lowered

    def queued(self, seconds: float) -> None:
        self.record.queued_s = round(seconds, 6)

    def reached(self, targets: list[str]) -> None:
        """The workers (or sibling processes) a fan-out or an abort went to."""
        self.record.targets = targets

    def resolved(self, model: str, target: str | None = None) -> None:
        """The model it named; `target`: the one an alias sent it to (it is placed there)."""
        self.model = model if target is None else target
        self.record.model, self.record.target = model, target

    def placed(self, reserved: ReservedPlacement, *, retry: bool) -> None:
        """An attempt starts on `reserved` (a retry: after a retryable failure)."""
        self.placements.append(reserved)
        record = self.record
        record.attempts += 1
        decision = reserved.decision
        if decision.expected_cached_tokens is not None:
            record.expected_cached_tokens = decision.expected_cached_tokens
            record.placed_on = decision.placed_on
        record.paced_on = decision.paced_on
        self._answered()  # an attempt before this one: its prefill is no longer ahead
        if decision.placed_on is not None:
            uncached = max(0, record.prompt_tokens - (decision.expected_cached_tokens or 0))
            self.hold = PrefillHold(decision.receiver, uncached)
            self.on_end(self.hold.done)
        record.retries += retry

    def _answered(self) -> None:
        """Its first message came (or another attempt starts): out of the backlog."""
        if self.hold is not None:
            self.hold.done()

    def called(self, leg: Role, worker: str, *, answers: bool) -> None:
        """A leg's upstream call goes to `worker` (`answers`: its stream is the client's)."""
        self.record.called(leg, worker)
        if answers:
            self.record.worker = worker

    def migrated(
        self, worker: str, cause: str, outcome: str, relayed: int, resent: int = 0
    ) -> None:
        """Its stream's `worker` failed after `relayed` tokens reached the client: went on
        elsewhere (`outcome` continued, re-sending `resent` tokens), or why not."""
        self.record.migrations.append((cause, outcome))
        self.record.resent_tokens += resent
        if self.trace is not None:
            self.trace.migration(worker, cause, outcome, relayed)

    def room(self, room: int) -> None:
        self.record.rooms.append(room)

    def handoff_failed(self, reason: str) -> None:
        self.record.handoff_failure = reason

    def cancelled(self) -> None:
        """The client went, or its deadline passed (grpc cancels the handler then). The
        gateway's copy of the deadline started as the call arrived, a little after the
        client's: a cancel within that slack of it is the deadline."""
        if self.told:  # its answer had ended: a cancel then changes nothing
            return
        expired = clients_deadline(self.context.time_remaining())
        self.record.code = "DEADLINE_EXCEEDED" if expired else "CANCELLED"

    def failed(self) -> None:
        """Ended by an exception: the status the handler set (abort), else UNKNOWN."""
        if self.told:
            return
        code = self.context.code()
        self.record.code = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"

    def handed_over(self) -> None:
        """Sent whole to the relay, which admits, charges, places and logs it as its own
        call: no placement here counts (its charge all back as it ends, no log line)."""
        self.record.attempts = 0
        self.handed = True

    def answer_began(self) -> None:
        """The worker's answer began (its headers), relayed by someone else (Envoy)."""
        self.record.first_message_s = time.perf_counter() - self.record.started
        self._answered()

    def ended_with(self, code: str) -> None:
        """The status its answer ended with, sent by someone else (Envoy relayed the
        worker's, or answered what the gateway told it to)."""
        self.record.code = code
        self.told = True

    def client(self, tally: Tally | None = None) -> Downstream:
        """The call's client side, made once (`tally`: Generate's usage, read as it ends)."""
        if self.downstream is None:
            self.downstream = Downstream(self.context, self.record, tally)
            self.downstream.on_first = self._answered
            self.on_end(self.downstream.tally)
        return self.downstream

    def logged(self, lines: Throttle) -> bool:
        """Whether its request line goes out at `lines`' rate (the next one says how many
        were held back)."""
        self.record.suppressed = lines.take()
        return self.record.suppressed is not None

    # -- the ending ----------------------------------------------------------------

    def on_end(self, callback: Callable[[], object]) -> None:
        """Run `callback` as the call ends (the last registered first)."""
        self.ending.callback(callback)

    def end(self) -> None:
        """Give back everything the stages took, once: every callback runs, whatever an
        earlier one raised (the last exception raised goes on)."""
        self.ending.close()

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """The call's one ending, whichever door it came through and however it ends
        (grpclib's `Stream.__aexit__`): its code from how it ended, the load report set
        while it still counts as in flight, what the stages took given back, then its
        door's call log has it. The exception, if any, goes on."""
        if isinstance(error, asyncio.CancelledError):
            self.cancelled()
        elif error is not None:
            self.failed()
        try:
            if self.orca is not None:
                self.orca.end()
            self.end()
        finally:
            if self.call_log is not None:
                self.call_log.ended(self)


async def abort_with_failure(context: Context, failure: UpstreamFailure) -> NoReturn:
    """End the client's call with an upstream failure's status and trailers."""
    await context.abort(failure.code, failure.message, failure.trailers)
    raise AssertionError("unreachable: abort raises")
