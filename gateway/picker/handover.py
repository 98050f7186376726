"""The picker's attempt: where the relay opens an upstream call, the picker names the
worker to Envoy (the request pinned to the rank placement chose, the caller's
credentials removed), then follows the response's headers and trailers to learn how
the worker answered. The reservation goes back with the worker's grpc-status (outlier
detection hears it), or with none if the client or Envoy ended the stream first (a
cancel says nothing about the worker). A Generate's answer is read for its usage on
the way (`usage`): the messages Envoy kept, on its trailers, or its body's pieces when
they pass the picker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from gateway.picker import wire
from gateway.picker.checks import WorkerChecks
from gateway.picker.context import PickerContext, ToRelay, picker_context
from gateway.picker.destinations import Destinations
from gateway.picker.usage import Answer, Answers
from gateway.picker.v3 import external_processor_pb2 as ext_proc
from gateway.proxy import Call, Job, ReservedPlacement, StageEnv, clients_deadline

# Past a call's deadline, how long the picker still waits for Envoy to say how it ended.
FOLLOW_SLACK_S = 1.0


class HandOver:
    """The attempt the dispatcher runs for a call the picker places."""

    __slots__ = ("_answers", "_checks", "_count", "_destinations")

    def __init__(
        self, checks: WorkerChecks, count: Callable[[str], None], answers: Answers
    ) -> None:
        self._checks = checks
        self._count = count  # the picker's answers, by kind
        self._destinations = Destinations()
        self._answers = answers  # where the Generates' answers are read for usage

    async def attempt(self, env: StageEnv, job: Job, reserved: ReservedPlacement) -> None:
        call = job.call
        context = picker_context(call)
        decision = reserved.decision
        worker = decision.lone
        try:
            address = await self._destinations.address(worker.spec.host, worker.spec.port)
        except OSError:
            raise ToRelay() from None  # the relay reaches it by name
        request = job.for_worker(job.raw, decision, worker)
        body = None if request is job.raw else request
        private = env.private_keys
        remove = tuple(k for k, _ in context.invocation_metadata() if k in private)
        ended = Ended()
        answer = self._answers.open(call.downstream, kept=not context.modes.response_duplex)
        with job.handed_over(env.routing.dispatcher.upstreams, reserved, worker) as reservation:
            try:
                self._count("worker")
                idle_s = env.config.limits.stream_idle_timeout_s
                to = (address, remove, body)
                await self._sent_and_followed(call, context, ended, to, answer, idle_s)
            finally:
                if answer is not None:
                    answer.close()
                code = ended.code
                if ended.known and code is not None:
                    call.ended_with(code.name)
                    if code is grpc.StatusCode.DEADLINE_EXCEEDED and clients_deadline(
                        context.time_remaining()
                    ):
                        code = None  # the client's own deadline: not the worker's doing
                if not ended.known and call.record.first_message_s is not None:
                    # The client left, or the worker's stream broke after its headers:
                    # Envoy then resets the client's stream and this one alike. A worker
                    # that is gone does not answer a health check: its reservation goes
                    # back with UNAVAILABLE.
                    self._checks.release_checked(reservation)
                else:
                    reservation.release(code)

    async def _sent_and_followed(
        self,
        call: Call,
        context: PickerContext,
        ended: Ended,
        to: tuple[str, tuple[str, ...], bytes | None],
        answer: Answer | None,
        idle_s: float,
    ) -> None:
        """The call sent to its worker (`to`: the address, the headers removed, a new
        request message if any), then its answer followed, each step within the call's
        deadline (and a little more: Envoy's own end of the stream says more), else
        within the idle timeout of the step before: a stream nobody answers gives its
        reservation back."""
        loop = asyncio.get_running_loop()
        left = context.time_remaining()
        deadline = None if left is None else loop.time() + left + FOLLOW_SLACK_S

        def bound() -> float | None:
            idle = loop.time() + idle_s if idle_s > 0 else None
            if deadline is None or idle is None:
                return deadline if idle is None else idle
            return min(deadline, idle)

        try:
            async with asyncio.timeout_at(bound()):
                await context.go_to(*to, mark=answer.mark if answer is not None else b"")
            while not ended.known:
                async with asyncio.timeout_at(bound()):
                    if not await _follow(call, context, ended, answer):
                        return
        except TimeoutError:
            call.ended_with(grpc.StatusCode.DEADLINE_EXCEEDED.name)


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


async def _follow(call: Call, context: PickerContext, ended: Ended, answer: Answer | None) -> bool:
    """The response's next part, answered unchanged; its headers and trailers say how
    the worker answered (`ended`), its body pieces (if they pass here) and trailers what
    it used (`answer`). False once the stream ends without a grpc-status: the client
    left, or Envoy reset it (or sent a part past the bounds)."""
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
        trailers = wire.header_list(request.response_trailers.trailers)
        ended.told(wire.grpc_status(trailers))
        reply = wire.GO_ON_RESPONSE_TRAILERS if answer is None else answer.trailers(trailers)
        await context.answer(reply)
    else:
        if answer is not None and part == "response_body":
            answer.body(request.response_body.body)
        await context.answer(wire.go_on(request, context.modes) or wire.GO_ON_RESPONSE_BODY)
    return True
