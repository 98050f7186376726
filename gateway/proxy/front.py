"""The front: one servicer per engine protocol, built from the engine's service descriptor.

Every RPC of the service is served with raw-bytes handlers (nothing is decoded unless
routing needs it), opened by the pipeline's first stages and then treated by its kind
(the table in `_make`): placed and relayed (Generate, Embed: the rest of the pipeline),
routed by request id (Abort: `aborts`), answered from the gateway's state (HealthCheck),
forwarded to one worker (fleet-wide facts) or fanned out to all and merged (per-worker
admin: `fleet_calls`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gateway.config import GatewayConfig
from gateway.core.current import Current
from gateway.engines import EngineAdapter, RpcKind, RpcSpec
from gateway.observability.record import CallRecord
from gateway.observability.tracing import TRACE_KEYS, Tracing
from gateway.proxy import stages
from gateway.proxy.aborts import AbortPeers, Aborts
from gateway.proxy.call import Call
from gateway.proxy.call_log import CallLog
from gateway.proxy.context import Context
from gateway.proxy.env import Entrance, Routing, StageEnv
from gateway.proxy.fleet_calls import FleetCalls
from gateway.proxy.idle import StreamIdle
from gateway.proxy.intake import ReadTimeout
from gateway.proxy.metadata import UNREAD
from gateway.proxy.reporting import OrcaContext
from gateway.proxy.stages import OPENING, PLACED

Handler = Callable[[Call], Awaitable[Any]]


class EngineFront:
    """Serves one engine protocol (SglangScheduler or VllmEngine) in front of the fleet.
    `observe` hears every call's record once it ends; `siblings`: the other serving
    processes (`--processes N`), for Aborts of calls they hold."""

    def __init__(
        self,
        adapter: EngineAdapter,
        settings: Current[GatewayConfig],
        door: Entrance,
        routing: Routing,
        observe: Callable[[CallRecord], None],
        siblings: AbortPeers | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.adapter = adapter
        self._door = door
        self.tracing = tracing
        config = settings.value
        self.call_log = CallLog(observe, config.log_level)  # how its calls are told of
        # With tracing on, the gateway continues the client's trace and sends workers its
        # own trace context: the client's is not forwarded as it is.
        private = door.identities.private_keys
        self.env = StageEnv(
            adapter,
            settings,
            door,
            routing,
            private | TRACE_KEYS if tracing is not None else private,
        )
        # The RPC kinds the pipeline does not place.
        abort_path = next(s.path for s in adapter.rpcs.values() if s.kind is RpcKind.ABORT)
        upstreams = routing.dispatcher.upstreams
        abort_wait_s = config.disagg.abort_wait_s
        self.aborts = Aborts(adapter, upstreams, abort_path, abort_wait_s, siblings)
        self.fleet_calls = FleetCalls(self.env)

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
            RpcKind.ABORT: self.aborts.abort,
            RpcKind.HEALTH_CHECK: self.fleet_calls.health_check,
            RpcKind.FORWARD_ONE: self.fleet_calls.forward_one,
            RpcKind.FAN_OUT: self.fleet_calls.fan_out,
        }[spec.kind]

        env, tracing = self.env, self.tracing
        # Past the opening, a call the pipeline does not place is its handler's doing.
        handled = None if spec.kind in (RpcKind.GENERATE, RpcKind.EMBED) else spec.kind.value
        settings = env.settings
        # Streams are ended once idle too long (`idle_s` 0: never).
        watch = self._door.idle if spec.server_streaming else None
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
            read_s = settings.value.limits.request_read_timeout_s
            idle = watch if watch is not None and watch.idle_s > 0 else None
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
