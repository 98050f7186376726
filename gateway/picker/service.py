"""The endpoint picker: Envoy's external processing service, one stream per call Envoy
relays.

A call passes the relay's own stages (`proxy/stages.py`) on the stream's parts: its
request headers open it (authenticated, admitted), its body is its request (decoded,
resolved, classified, charged, waiting in its model's queue with flow control), and the
dispatcher's one attempt loop places it, with an attempt that hands the placement to
Envoy instead of opening an upstream call: the answer names the worker's `IP:PORT` (the
body's, or in FULL_DUPLEX_STREAMED the headers', with the body handed back), and the
attempt then follows the response's headers and trailers to learn how the worker
answered. The call ends with the stream: its reservation goes
back with the worker's grpc-status (outlier detection hears it), or with none if the
client or Envoy ended the stream first (a cancel says nothing about the worker).

What Envoy cannot run alone goes to the relay, whole: the other RPCs at their headers,
a disaggregated Generate (and with `picker.migrate_streams`, every streamed Generate)
once its model is known, a body the picker does not hold whole (past
`picker.max_body_bytes`, cut short by Envoy, or one Envoy sends only once the call is
routed). Every other answer the picker gives is the relay's: a verdict
travels as an ImmediateResponse with the same grpc-status, message and trailers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from gateway.config import GatewayConfig
from gateway.core.roles import Runtime
from gateway.engines import RpcKind, RpcSpec
from gateway.observability.record import CallRecord
from gateway.picker import wire
from gateway.picker.context import (
    Answered,
    PickerContext,
    TrustedProxies,
    Unreadable,
    hand_back,
)
from gateway.picker.destinations import Destinations, endpoint, literal
from gateway.picker.v3 import external_processor_pb2 as ext_proc
from gateway.proxy import stages
from gateway.proxy.call import Call
from gateway.proxy.front import UNREAD, EngineFront
from gateway.proxy.inflight import Holder
from gateway.proxy.intake import NO_REQUEST, ReadGate, ReadTimeout
from gateway.proxy.job import Job
from gateway.proxy.stages import REGULAR_ONLY, Env, Stage
from gateway.proxy.status import abort_invalid
from gateway.proxy.upstream import CLIENT_DEADLINE_SLACK_S, Reserved
from gateway.security.identity import Identities

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PICKED_KINDS = frozenset({RpcKind.GENERATE, RpcKind.EMBED, RpcKind.ABORT})
# Past a call's deadline, how long the picker still waits for Envoy to say how it ended.
FOLLOW_SLACK_S = 1.0


class ToRelay(Exception):
    """The call is the relay's to run whole (a disaggregated pair, a migratable stream)."""


class Picker:
    """Serves `ExternalProcessor/Process` for the engine fronts' protocols."""

    def __init__(
        self,
        fronts: list[EngineFront],
        config: GatewayConfig,
        relay_address: str,
        count: Callable[[str], None] = lambda answer: None,
        identities: Identities | None = None,
    ) -> None:
        """`identities`: who the picker's calls come from, if not the fronts' (the picker's
        failed authentications are counted apart from the main port's)."""
        self._by_path: dict[str, tuple[EngineFront, RpcSpec]] = {
            spec.path: (front, spec) for front in fronts for spec in front.adapter.rpcs.values()
        }
        picker = config.picker
        self._header = picker.header
        self._relay = relay_address
        self._whole_to_relay = wire.whole_to(picker.header, relay_address)
        self._max_body = picker.max_body_bytes
        self._trusted = TrustedProxies(picker.trusted_proxies)
        self._migrate_streams = picker.migrate_streams
        self._count = count  # each call's answer: `worker`, `relay` or `verdict`
        self._destinations = Destinations()
        self._check_s = config.probe.timeout_s  # the check of a worker whose stream broke
        limits = config.limits
        self._read_s = limits.request_read_timeout_s
        self._idle_s = limits.stream_idle_timeout_s
        # The picker's own turns to read a request: it never takes the main port's.
        gate = ReadGate(limits.max_request_reads, limits.max_request_reads_per_peer)
        self._envs: dict[Runtime, Env] = {}
        for front in fronts:
            door = replace(front.env.door, gate=gate)
            if identities is not None:
                door = replace(door, identities=identities)
            self._envs[front.adapter.runtime] = replace(front.env, door=door)
        self._placed: tuple[Stage, ...] = (
            stages.decode,
            stages.resolve,
            self._regular_only,
            stages.classify,
            stages.charge,
            stages.wait,
        )

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(
            self._process,
            request_deserializer=wire.parse,  # headers bounded before they are parsed
            response_serializer=None,  # answers are built as bytes (`wire`)
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Process": method})

    async def _process(self, _requests: Any, stream: aio.ServicerContext) -> None:
        """One call's stream. Everything before the request is read is bounded by the read
        timeout from the stream's opening, as on the main port; a placed call's wait for
        its answer by the call's deadline, else the idle timeout. The picker ends the
        stream once nothing more of the call needs it (Envoy then goes on alone)."""
        opened_at = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout_at(opened_at + self._read_s):
                request = await stream.read()
        except TimeoutError:
            return  # not even the headers came: nothing to answer
        if request is aio.EOF:
            return
        if isinstance(request, wire.Oversized):
            self._count("verdict")
            await _bounded(stream.write(_oversized(request)), self._read_s)
            return
        modes = wire.modes(request)
        part = request.WhichOneof("request")
        if part != "request_headers":  # a filter not set to send the request's headers
            await _bounded(self._pass(stream, modes, request), self._read_s)
            return
        headers = wire.header_list(request.request_headers.headers)
        path = next((v for k, v in headers if k == ":path"), "")
        found = self._by_path.get(path)
        bodiless = request.request_headers.end_of_stream
        if found is None or found[1].kind not in PICKED_KINDS or not modes.placeable:
            # The relay answers it as it would anyway (and reads a body the picker
            # would see only once the call is routed: STREAMED, NONE).
            self._count("relay")  # counted as decided: the call may end before the write does
            await _bounded(self._pass_to_relay(stream, modes, bodiless), self._read_s)
            return
        front, spec = found
        context = PickerContext(
            stream, headers, self._header, modes, self._max_body, self._trusted, bodiless
        )
        record = CallRecord(rpc=spec.name, service=front.adapter.service_name, picked=True)
        trace = None
        if front.tracing is not None:
            trace = front.tracing.start(record, context.invocation_metadata(), context.peer())
        call = Call(spec, context, record, UNREAD, "", trace=trace, call_log=front.call_log)
        async with call:
            await self._run(self._envs[front.adapter.runtime], call, context, opened_at)

    async def _run(self, env: Env, call: Call, context: PickerContext, opened_at: float) -> None:
        read_s = self._read_s
        limit = asyncio.timeout_at(opened_at + read_s)
        try:
            try:
                async with limit:
                    await stages.open_call(env, call)
                    await stages.admit(env, call)
                    if context.bodiless:  # refused as the relay refuses a call with no message
                        await abort_invalid(context, NO_REQUEST)
                    await context.headers_read()
                    await stages.read(env, call)
                    if call.spec.kind is RpcKind.ABORT:
                        await context.go_to(self._abort_destination(env, call))
                        return
            except TimeoutError:
                if not limit.expired():
                    raise
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    str(ReadTimeout(read_s)),
                    (("x-http-status", "408"),),
                )
            for stage in self._placed:
                await stage(env, call)
            attempt = functools.partial(self._handed_over, env)
            assert call.place is not None
            job = Job(call, env.adapter, call.request, call.client(), call.record.request_id)
            await env.routing.dispatcher.serve(job, call.place, attempt, call.placed_ahead)
        except (ToRelay, Unreadable):
            call.handed_over()
            call.end()  # what it took goes back first: the relay takes its own
            self._count("relay")
            await _bounded(self._relay_rest(context), read_s)
        except Answered as answered:  # Envoy answers the client: it sends nothing more
            call.ended_with(answered.code.name)
            self._count("verdict")
            await _bounded(context.answer(answered.answer), read_s)

    async def _relay_rest(self, context: PickerContext) -> None:
        await context.go_to(self._relay)
        await context.hand_back()

    async def _pass(
        self, stream: aio.ServicerContext, modes: wire.Modes, request: ext_proc.ProcessingRequest
    ) -> None:
        """A part the picker does nothing with, answered unchanged, and then what is left
        of the request's body, if it streams through the picker."""
        await stream.write(wire.go_on(request, modes) or wire.GO_ON_REQUEST_HEADERS)
        part = request.WhichOneof("request")
        if part == "request_body":
            await hand_back(stream, modes, request.request_body.end_of_stream)

    async def _pass_to_relay(
        self, stream: aio.ServicerContext, modes: wire.Modes, bodiless: bool
    ) -> None:
        await stream.write(self._to_relay(modes))
        await hand_back(stream, modes, bodiless)

    def _to_relay(self, modes: wire.Modes) -> bytes:
        """The answer to the headers of a call the relay runs whole."""
        if modes.request_duplex:  # the body may be on its way: handed back as it comes
            return wire.headers_to(self._header, self._relay)
        return self._whole_to_relay

    async def _regular_only(self, env: Env, call: Call) -> None:
        """A stage: a call Envoy cannot run alone goes to the relay whole (a disaggregated
        pair; with `picker.migrate_streams`, any stream), before it is classified,
        charged or queued (the relay does that)."""
        info = call.info
        legs = env.routing.placer.legs(call.model, bool(info.mm_items) if info else False)
        if legs != REGULAR_ONLY or (self._migrate_streams and call.spec.server_streaming):
            raise ToRelay()

    async def _handed_over(self, env: Env, job: Job, reserved: Reserved) -> None:
        """The attempt: the worker named to Envoy (the request pinned to the rank
        placement chose, the caller's credentials removed), then the response followed
        to its end; the reservation goes back with the worker's grpc-status."""
        call = job.call
        context = call.context
        assert isinstance(context, PickerContext)
        decision = reserved.decision
        worker = decision.lone
        reservation = reserved.take(worker)
        upstreams = env.routing.dispatcher.upstreams
        holder = Holder(worker, job.upstream_id, call.record.principal, direct=True)
        ended = Ended()
        try:
            try:
                address = await self._destinations.address(worker.spec.host, worker.spec.port)
            except OSError:
                raise ToRelay() from None  # the relay reaches it by name
            call.called(worker.role, worker.id, answers=True)
            request = job.for_worker(job.raw, decision, worker)
            body = None if request is job.raw else request
            private = env.private_keys
            remove = tuple(k for k, _ in context.invocation_metadata() if k in private)
            upstreams.inflight.add(job.upstream_id, holder)
            self._count("worker")
            await self._sent_and_followed(call, context, ended, address, remove, body)
        finally:
            upstreams.inflight.discard(job.upstream_id, holder)
            code = ended.code
            if ended.known and code is not None:
                call.ended_with(code.name)
                if code is grpc.StatusCode.DEADLINE_EXCEEDED and _clients_deadline(context):
                    code = None  # the client's own deadline: not the worker's doing
            if not ended.known and call.record.first_message_s is not None:
                # The client left, or the worker's stream broke after its headers: Envoy
                # then resets the client's stream and this one alike. A worker that is
                # gone does not answer a health check: its reservation goes back with
                # UNAVAILABLE.
                upstreams.release_checked(reservation, self._check_s)
            else:
                reservation.release(code)

    async def _sent_and_followed(
        self,
        call: Call,
        context: PickerContext,
        ended: Ended,
        address: str,
        remove: tuple[str, ...],
        body: bytes | None,
    ) -> None:
        """The call sent to its worker, then its answer followed, each step within the
        call's deadline (and a little more: Envoy's own end of the stream says more),
        else within the idle timeout of the step before: a stream nobody answers gives
        its reservation back."""
        loop = asyncio.get_running_loop()
        left = context.time_remaining()
        deadline = None if left is None else loop.time() + left + FOLLOW_SLACK_S
        idle_s = self._idle_s

        def bound() -> float | None:
            idle = loop.time() + idle_s if idle_s > 0 else None
            if deadline is None or idle is None:
                return deadline if idle is None else idle
            return min(deadline, idle)

        try:
            async with asyncio.timeout_at(bound()):
                await context.go_to(address, remove, body)
            while not ended.known:
                async with asyncio.timeout_at(bound()):
                    if not await _follow(call, context, ended):
                        return
        except TimeoutError:
            call.ended_with(grpc.StatusCode.DEADLINE_EXCEEDED.name)

    def _abort_destination(self, env: Env, call: Call) -> str:
        """Where an Abort goes: straight to the one worker that runs every request it
        names, if the picker placed them all there; else to the relay, which finds every
        holder (the picker's too) and asks the sibling processes."""
        try:
            ids = env.adapter.abort_ids(call.request)
        except DecodeError:
            raise ToRelay() from None  # it answers INVALID_ARGUMENT
        inflight = env.routing.dispatcher.upstreams.inflight
        holders = [h for i in ids for h in inflight.holders(i, call.record.principal)]
        workers = {h.worker for h in holders}
        found = {h.upstream_id for h in holders}
        if len(workers) != 1 or found != set(ids) or not all(h.direct for h in holders):
            raise ToRelay()
        (worker,) = workers
        ip = literal(worker.spec.host)
        if ip is None:
            raise ToRelay()
        self._count("worker")
        return endpoint(ip, worker.spec.port)


class Ended:
    """How the worker's answer ended, once Envoy has told (`known`): its grpc-status
    (None: it sent none). Known before the picker's last answer goes out, so Envoy
    closing the stream as soon as it has that answer changes nothing."""

    __slots__ = ("code", "known")

    def __init__(self) -> None:
        self.known = False
        self.code: grpc.StatusCode | None = None

    def told(self, code: grpc.StatusCode | None) -> None:
        self.known, self.code = True, code


async def _follow(call: Call, context: PickerContext, ended: Ended) -> bool:
    """The response's next part, answered unchanged; its headers and trailers say how
    the worker answered (`ended`). False once the stream ends without a grpc-status: the
    client left, or Envoy reset it (or sent a part past the bounds)."""
    request = await context.next_part()
    if not isinstance(request, ext_proc.ProcessingRequest):
        call.ended_with("CANCELLED")
        return False
    part = request.WhichOneof("request")
    if part == "response_headers":
        headers = request.response_headers
        if headers.end_of_stream:  # Trailers-Only
            ended.told(wire.grpc_status(wire.header_list(headers.headers)))
        else:
            call.answer_began()
        await context.answer(wire.GO_ON_RESPONSE_HEADERS)
    elif part == "response_trailers":
        ended.told(wire.grpc_status(wire.header_list(request.response_trailers.trailers)))
        await context.answer(wire.GO_ON_RESPONSE_TRAILERS)
    else:
        await context.answer(wire.go_on(request, context.modes) or wire.GO_ON_RESPONSE_BODY)
    return True


async def _bounded(step: Awaitable[None], seconds: float) -> None:
    """`step` within `seconds` (a peer that stops reading its answers holds nothing)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await step


def _oversized(request: wire.Oversized) -> bytes:
    return wire.immediate(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"Request headers too large for the gateway: {request.detail}",
        (("x-http-status", "431"),),
    )


def _clients_deadline(context: PickerContext) -> bool:
    left = context.time_remaining()
    return left is not None and left <= CLIENT_DEADLINE_SLACK_S
