"""The front: one servicer per engine protocol, built from the engine's service descriptor.

Every RPC of the service is served with raw-bytes handlers (nothing is decoded unless
routing needs it) and treated by its kind: placed and relayed (Generate, Embed), routed
by request id (Abort), answered from the gateway's state (HealthCheck), forwarded to one
worker (fleet-wide facts) or fanned out to all and merged (per-worker admin).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from gateway.config import DEFAULT_COST_TOKENS, GatewayConfig
from gateway.core.roles import Role
from gateway.engines import EngineAdapter, RpcKind, RpcSpec
from gateway.observability.record import CallRecord
from gateway.observability.tracing import TRACE_KEYS, Tracing
from gateway.placement.decision import Decision
from gateway.placement.policies import Hints
from gateway.placement.verdicts import Verdict, shown
from gateway.proxy import stages
from gateway.proxy.call import Call, CallLog, Context, abort_with_failure
from gateway.proxy.idle import StreamIdle
from gateway.proxy.inflight import Holder
from gateway.proxy.intake import ReadTimeout
from gateway.proxy.job import Job
from gateway.proxy.metadata import Metadata, RequestMeta
from gateway.proxy.reporting import OrcaContext
from gateway.proxy.stages import OPENING, PLACED, Door, Env, Routing
from gateway.proxy.status import abort_invalid
from gateway.proxy.upstream import Outbound, UpstreamFailure

Handler = Callable[[Call], Awaitable[Any]]
UNREAD = RequestMeta(model=None, hints=Hints(), forward=())  # before `open` reads it

__all__ = ["Door", "EngineFront", "Routing"]


class Siblings(Protocol):
    """The other serving processes of this gateway (`--processes N`)."""

    async def abort_held(
        self,
        service: str,
        request: bytes,
        principal: str | None,
        forward: Metadata,
        time_left: float | None,
    ) -> list[bytes]:
        """The replies of the siblings that held a named request."""


SHOWN_IDS = 8  # request ids an answer repeats (a vLLM Abort may name any number)


def named(ids: list[str]) -> str:
    """Client-supplied ids as an answer repeats them: a few, each bounded."""
    shown_ids = ", ".join(repr(shown(i)) for i in ids[:SHOWN_IDS])
    more = len(ids) - SHOWN_IDS
    return shown_ids + (f" and {more} more" if more > 0 else "")


class EngineFront:
    """Serves one engine protocol (SglangScheduler or VllmEngine) in front of the fleet.
    `observe` hears every call's record once it ends; `siblings`: the other serving
    processes (`--processes N`), for Aborts of calls they hold."""

    def __init__(
        self,
        adapter: EngineAdapter,
        config: GatewayConfig,
        door: Door,
        routing: Routing,
        observe: Callable[[CallRecord], None],
        siblings: Siblings | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.adapter = adapter
        self._config = config
        self._door = door
        self._siblings = siblings
        self._abort_path = next(
            spec.path for spec in adapter.rpcs.values() if spec.kind is RpcKind.ABORT
        )
        self._draining = False  # `drain()`: the engine HealthCheck then says unhealthy
        self._registry = routing.registry
        self._placer = routing.placer
        self._dispatcher = routing.dispatcher
        self._upstreams = routing.dispatcher.upstreams
        self.tracing = tracing
        self.call_log = CallLog(observe, config.log_level)  # how its calls are told of
        # With tracing on, the gateway continues the client's trace and sends workers its
        # own trace context: the client's is not forwarded as it is.
        private = door.identities.private_keys
        flow = config.flow  # a call's output, when it does not say: estimated
        self.env = Env(
            adapter,
            config,
            door,
            routing,
            private | TRACE_KEYS if tracing is not None else private,
            flow.cost_tokens if flow is not None else DEFAULT_COST_TOKENS,
        )

    def drain(self) -> None:
        """SIGTERM: from now on the engine HealthCheck answers unhealthy, so a client's
        own health checking moves it elsewhere while calls in flight finish."""
        self._draining = True

    def handler(self) -> grpc.GenericRpcHandler:
        """Every method served as request-streaming (the same on the wire for the client):
        the front reads the request itself, so the read is bounded (see `intake`)."""
        handlers = {}
        for spec in self.adapter.rpcs.values():
            run = self._make(spec)
            if spec.server_streaming:
                handlers[spec.name] = grpc.stream_stream_rpc_method_handler(run)
            else:
                handlers[spec.name] = grpc.stream_unary_rpc_method_handler(run)
        return grpc.method_handlers_generic_handler(self.adapter.service_name, handlers)

    def _make(self, spec: RpcSpec) -> Callable[[Any, Context], Awaitable[Any]]:
        serve: Handler = {
            RpcKind.GENERATE: self._placed,
            RpcKind.EMBED: self._placed,
            RpcKind.ABORT: self._abort,
            RpcKind.HEALTH_CHECK: self._health_check,
            RpcKind.FORWARD_ONE: self._forward_one,
            RpcKind.FAN_OUT: self._fan_out,
        }[spec.kind]

        env, tracing = self.env, self.tracing
        # Past the opening, a call the pipeline does not place is its handler's doing.
        handled = None if spec.kind in (RpcKind.GENERATE, RpcKind.EMBED) else spec.kind.value
        read_s = self._config.limits.request_read_timeout_s
        # Streams are ended once idle too long (0: never).
        idle = self._door.idle if spec.server_streaming and self._door.idle.idle_s > 0 else None
        load = self._door.load
        call_log = self.call_log

        async def run(_requests: Any, context: Context) -> Any:
            orca = None
            if load is not None:  # every way the call ends carries the load report
                context = orca = OrcaContext(context, load)
            record = CallRecord(rpc=spec.name, service=self.adapter.service_name)
            trace = None
            if tracing is not None:  # the SERVER span: from the stream's opening
                trace = tracing.start(record, context.invocation_metadata(), context.peer())
            call = Call(
                spec, context, record, UNREAD, "", trace=trace, orca=orca, call_log=call_log
            )
            async with call:
                # One deadline per call: the read timeout, from the stream's opening; then
                # a stream's is the idle watch's to set (once nothing moved for a period).
                limit = asyncio.timeout_at(asyncio.get_running_loop().time() + read_s)
                opened = False
                try:
                    async with limit:
                        await stages.run(OPENING, env, call)
                        opened = True
                        if handled is not None:
                            call.entered(handled)
                        if idle is None:
                            limit.reschedule(None)
                            return await serve(call)
                        idle.watch(record, limit)
                        try:
                            return await serve(call)
                        finally:
                            idle.forget(limit)
                except TimeoutError:
                    if not limit.expired():
                        raise
                    if opened:
                        idle_s = self._door.idle.idle_s
                        await context.abort(
                            grpc.StatusCode.DEADLINE_EXCEEDED, str(StreamIdle(idle_s))
                        )
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        str(ReadTimeout(read_s)),
                        (("x-http-status", "408"),),
                    )

        return run

    async def _placed(self, call: Call) -> bytes | None:
        """Generate and Embed: the rest of the pipeline (`proxy/stages.py`)."""
        await stages.run(PLACED, self.env, call)
        return call.reply

    async def _model(self, call: Call) -> str:
        await stages.resolve(self.env, call)
        return call.model

    async def _forward_one(self, call: Call) -> bytes | None:
        meta = call.meta
        model = await self._model(call)
        runtime = self.adapter.runtime
        target = meta.hints.target_worker

        def pick(tried: Collection[str]) -> Decision | Verdict:
            if target is not None and target not in tried:
                worker = self._registry.get(target)
                if (
                    worker is not None
                    and worker.model == model
                    and worker.role is not Role.ENCODE
                    and worker.available(time.monotonic())
                ):
                    return Decision.single(worker)
            placed = self._placer.any_worker(model, runtime, tried)
            return placed if isinstance(placed, Verdict) else Decision.single(placed)

        attempt = self._dispatcher.attempt(call.spec.server_streaming)
        job = Job(call, self.adapter, call.request, call.client(), call.record.request_id)
        return await self._dispatcher.serve(job, pick, attempt)

    async def _fan_out(self, call: Call) -> bytes:
        spec, request, context, record, meta = (
            call.spec, call.request, call.context, call.record, call.meta
        )  # fmt: skip
        model = await self._model(call)
        workers = self._placer.every_worker(model, self.adapter.runtime)
        if isinstance(workers, Verdict):
            await call.refuse(workers)
        call.reached([w.id for w in workers])
        upstreams = self._upstreams
        outbound = Outbound(spec.path, request, meta.forward, context.time_remaining())
        legs = [upstreams.ask(upstreams.reserve(w), outbound) for w in workers]
        try:
            results = await asyncio.gather(*(c.response() for c in legs), return_exceptions=True)
        finally:
            for leg in legs:
                leg.close()
        for result in results:
            if isinstance(result, UpstreamFailure):
                await abort_with_failure(context, result)
            elif isinstance(result, BaseException):
                raise result
        await context.send_initial_metadata((("x-gateway-workers", ",".join(record.targets)),))
        return self.adapter.merge(spec.name, [r for r in results if isinstance(r, bytes)])

    async def _health_check(self, call: Call) -> bytes:
        model = await self._model(call)
        if self._draining:
            return self.adapter.health_check_reply(False, "the gateway is shutting down")
        if self._placer.servable(model, self.adapter.runtime):
            return self.adapter.health_check_reply(True, f"model '{model}' is servable")
        return self.adapter.health_check_reply(False, f"model '{model}' has no available workers")

    async def _abort_one(
        self, path: str, request: bytes, holder: Holder, forward: Metadata, time_left: float | None
    ) -> bytes:
        """Abort one upstream call; a decode leg only once it has started (bounded), so the
        KV handoff from its prefill is not torn in the middle. An abort says nothing about
        the worker's health: it is counted in flight, never judged."""
        if holder.started is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.disagg.abort_wait_s):
                    await holder.started.wait()
        upstreams = self._upstreams
        abort = self.adapter.abort_request([holder.upstream_id], request)
        reservation = upstreams.reserve(holder.worker, judge=False)
        with upstreams.ask(reservation, Outbound(path, abort, forward, time_left)) as call:
            return await call.response()

    async def abort_held(
        self,
        request: bytes,
        ids: list[str],
        principal: str | None,
        forward: Metadata,
        time_left: float | None,
    ) -> bytes | None:
        """Abort what this process holds of `ids` for `principal`: the merged engine reply,
        or None if it holds none of them (the peer service asks the same of siblings)."""
        holders, _ = self._held(ids, principal)
        return await self._abort_holders(request, holders, forward, time_left)

    def _held(self, ids: list[str], principal: str | None) -> tuple[list[Holder], bool]:
        """The upstream calls this process holds for the named requests, and whether it
        holds every one of them."""
        inflight = self._upstreams.inflight
        found = [inflight.holders(request_id, principal) for request_id in ids]
        return [h for holders in found for h in holders], all(found)

    async def _abort_holders(
        self,
        request: bytes,
        holders: list[Holder],
        forward: Metadata,
        time_left: float | None,
    ) -> bytes | None:
        if not holders:
            return None
        path = self._abort_path
        results = await asyncio.gather(
            *(self._abort_one(path, request, h, forward, time_left) for h in holders),
            return_exceptions=True,
        )
        replies = [r for r in results if isinstance(r, bytes)]
        if not replies:
            failure = next(r for r in results if isinstance(r, BaseException))
            detail = failure.details if isinstance(failure, UpstreamFailure) else str(failure)
            return self.adapter.abort_reply(False, f"abort failed: {detail}")
        return self.adapter.merge_aborts(replies)

    async def _abort(self, call: Call) -> bytes:
        """Abort where the requests run: in this process, and in sibling processes for
        the ones it does not hold."""
        request, context, record = call.request, call.context, call.record
        try:
            ids = self.adapter.abort_ids(request)
        except DecodeError:
            await abort_invalid(context, "Request bytes are not a valid AbortRequest")
        call.named(",".join(ids))
        principal, forward = record.principal, call.meta.forward
        timeout = context.time_remaining()
        holders, all_here = self._held(ids, principal)  # before any await
        reached = [h.worker.id for h in holders]
        call.reached(reached)
        local = await self._abort_holders(request, holders, forward, timeout)
        replies = [local] if local is not None else []
        if self._siblings is not None and not all_here:
            # Some named request runs elsewhere (a vLLM Abort may name several): the
            # siblings abort what they hold of them, nothing this process holds.
            remote = await self._siblings.abort_held(
                self.adapter.service_name, request, principal, forward, timeout
            )
            if remote:
                call.reached([*reached, "sibling process"])
            replies += remote
        if not replies:
            return self.adapter.abort_reply(False, f"request {named(ids)} is not in flight here")
        return replies[0] if len(replies) == 1 else self.adapter.merge_aborts(replies)
