"""The endpoint picker: Envoy's external processing service, one stream per call Envoy
relays.

A call passes the relay's own pipeline (`proxy/stages.py`) in the picker's mode
(`picker/stages.py`) on the stream's parts: its request headers open it (authenticated,
admitted), its body is its request (decoded, resolved, classified, charged, waiting in
its model's queue with flow control), and the dispatcher's one attempt loop places it,
with an attempt that hands the placement to Envoy instead of opening an upstream call
(`picker/handover.py`): the answer names the worker's `IP:PORT` (the body's, or in
FULL_DUPLEX_STREAMED the headers', with the body handed back), and the attempt then
follows the response's headers and trailers to learn how the worker answered.

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
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import grpc
from grpc import aio

from gateway.config import GatewayConfig
from gateway.core.roles import Runtime
from gateway.engines import RpcKind, RpcSpec
from gateway.observability.record import CallRecord
from gateway.picker import wire
from gateway.picker.checks import WorkerChecks
from gateway.picker.context import (
    Answered,
    PickerContext,
    ToRelay,
    TrustedProxies,
    Unreadable,
    hand_back,
)
from gateway.picker.handover import HandOver
from gateway.picker.stages import PickerStages
from gateway.picker.usage import Answers
from gateway.picker.v3 import external_processor_pb2 as ext_proc
from gateway.proxy import UNREAD, Call, EngineFront, ReadGate, ReadTimeout, StageEnv, stages
from gateway.security.identity import Identities

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PICKED_KINDS = frozenset({RpcKind.GENERATE, RpcKind.EMBED, RpcKind.ABORT})


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
        self._count = count  # each call's answer: `worker`, `relay` or `verdict`
        limits = config.limits
        self._settings = fronts[0].env.settings  # the config in force (a reload's)
        # The picker's own turns to read a request: it never takes the main port's.
        gate = ReadGate(limits.max_request_reads, limits.max_request_reads_per_peer)
        self._envs: dict[Runtime, StageEnv] = {}
        for front in fronts:
            door = replace(front.env.door, gate=gate)
            if identities is not None:
                door = replace(door, identities=identities)
            self._envs[front.adapter.runtime] = replace(front.env, door=door)
        checks = WorkerChecks(fronts[0].env.routing.dispatcher.upstreams, config.probe.timeout_s)
        # Placed Generates' answers, read for their usage (a budget for what they hold).
        self.answers = Answers()
        hand_over = HandOver(checks, count, self.answers)
        self.stages = PickerStages(hand_over, picker.migrate_streams, count)

    @property
    def _read_s(self) -> float:
        return self._settings.value.limits.request_read_timeout_s

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

    async def _run(
        self, env: StageEnv, call: Call, context: PickerContext, opened_at: float
    ) -> None:
        read_s = self._read_s
        limit = asyncio.timeout_at(opened_at + read_s)
        try:
            try:
                async with limit:
                    await stages.run(self.stages.opening, env, call)
                    if call.spec.kind is RpcKind.ABORT:
                        call.entered(RpcKind.ABORT.value)
                        await context.go_to(self.stages.abort_destination(env, call))
                        return
            except TimeoutError:
                if not limit.expired():
                    raise
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    str(ReadTimeout(read_s)),
                    (("x-http-status", "408"),),
                )
            await stages.run(self.stages.placed, env, call)
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
