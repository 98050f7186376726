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
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc import aio

from gateway.config import GatewayConfig
from gateway.engines import EngineAdapter, RpcKind, RpcSpec
from gateway.fleet.registry import Registry
from gateway.fleet.worker import Worker
from gateway.placement.placer import Assignment, Placer
from gateway.placement.verdicts import Verdict
from gateway.proxy.disagg import DisaggregatedDispatch
from gateway.proxy.dispatch import CallRecord, Context, Dispatcher, refuse
from gateway.proxy.inflight import Holder, InflightTable
from gateway.proxy.metadata import RequestMeta, clean, read_request_meta
from gateway.proxy.status import abort_invalid
from gateway.roles import Role

log = structlog.get_logger("gateway.request")

REGULAR_ONLY = (Role.REGULAR,)

Handler = Callable[[bytes, Context], Awaitable[Any]]


class EngineFront:
    """Serves one engine protocol (SglangScheduler or VllmEngine) in front of the fleet."""

    def __init__(
        self,
        adapter: EngineAdapter,
        config: GatewayConfig,
        registry: Registry,
        placer: Placer,
        dispatcher: Dispatcher,
        inflight: InflightTable,
        disagg: DisaggregatedDispatch,
        observe: Callable[[CallRecord], None],
    ) -> None:
        self._disagg = disagg
        self.draining = False  # set on SIGTERM: the engine HealthCheck then says unhealthy
        self.adapter = adapter
        self._observe = observe
        self._config = config
        self._registry = registry
        self._placer = placer
        self._dispatcher = dispatcher
        self._inflight = inflight

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = {}
        for spec in self.adapter.rpcs.values():
            run = self._make(spec)
            if spec.server_streaming:
                handlers[spec.name] = grpc.unary_stream_rpc_method_handler(run)
            else:
                handlers[spec.name] = grpc.unary_unary_rpc_method_handler(run)
        return grpc.method_handlers_generic_handler(self.adapter.service_name, handlers)

    def _make(self, spec: RpcSpec) -> Handler:
        serve = {
            RpcKind.GENERATE: self._placed,
            RpcKind.EMBED: self._placed,
            RpcKind.ABORT: self._abort,
            RpcKind.HEALTH_CHECK: self._health_check,
            RpcKind.FORWARD_ONE: self._forward_one,
            RpcKind.FAN_OUT: self._fan_out,
        }[spec.kind]

        async def run(request: bytes, context: Context) -> Any:
            record = CallRecord(rpc=spec.name, service=self.adapter.service_name)
            try:
                return await serve(spec, request, context, record)
            except asyncio.CancelledError:
                record.code = "CANCELLED"
                raise
            except BaseException:
                code = context.code()
                record.code = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                self._log(record)

        return run

    def _log(self, record: CallRecord) -> None:
        self._observe(record)
        first = record.first_message_s
        log.info(
            "request",
            model=record.model,
            service=record.service,
            rpc=record.rpc,
            worker=record.workers[-1] if record.workers else None,
            workers=record.workers if len(record.workers) > 1 else None,
            attempts=len(record.workers),
            legs=record.legs,
            code=record.code,
            reason=record.verdict.reason.name if record.verdict else None,
            first_message_ms=round(first * 1000, 3) if first is not None else None,
            duration_ms=round((time.perf_counter() - record.started) * 1000, 3),
            messages=record.messages,
            request_id=record.request_id or None,
            rooms=record.rooms or None,
        )

    def _meta(self, context: Context) -> RequestMeta:
        config = self._config
        return read_request_meta(
            context.invocation_metadata(),
            config.model_headers,
            config.routing_key_header,
            config.target_worker_header,
        )

    async def _model(self, context: Context, meta: RequestMeta, record: CallRecord) -> str:
        resolved = self._placer.resolve(meta.model, self.adapter.runtime)
        if isinstance(resolved, Verdict):
            record.model = meta.model or ""
            await refuse(context, record, resolved)
        record.model = resolved
        return resolved

    async def _placed(
        self, spec: RpcSpec, request: bytes, context: Context, record: CallRecord
    ) -> bytes | None:
        if spec.kind is RpcKind.GENERATE:
            try:
                info = self.adapter.generate_info(request)
            except DecodeError:
                await abort_invalid(context, "Request bytes are not a valid GenerateRequest")
            record.request_id = info.request_id
        else:
            try:
                spec.request_type.FromString(request)
            except DecodeError:
                await abort_invalid(context, f"Request bytes are not a valid {spec.name} request")
        meta = self._meta(context)
        model = await self._model(context, meta, record)
        runtime, placer, hints = self.adapter.runtime, self._placer, meta.hints
        items = info.mm_items if spec.kind is RpcKind.GENERATE else ()
        legs = placer.legs(model, bool(items))

        def place(tried: Collection[str]) -> Assignment | Verdict:
            return placer.place(model, runtime, hints, items, tried, legs)

        if spec.kind is RpcKind.GENERATE and legs != REGULAR_ONLY:
            record.legs = "+".join(leg.value for leg in legs)
            await self._disagg.generate(
                context,
                self.adapter,
                request,
                info.n,
                info.return_logprob,
                meta.forward,
                place,
                record,
            )
            return None

        def pick(tried: Collection[str]) -> Worker | Verdict:
            placed = place(tried)
            return placed if isinstance(placed, Verdict) else placed.receiver

        return await self._dispatcher.forward(
            context,
            spec.path,
            request,
            meta.forward,
            pick,
            record,
            streaming=spec.server_streaming,
        )

    async def _forward_one(
        self, spec: RpcSpec, request: bytes, context: Context, record: CallRecord
    ) -> bytes | None:
        meta = self._meta(context)
        model = await self._model(context, meta, record)
        runtime = self.adapter.runtime
        target = meta.hints.target_worker

        def pick(tried: Collection[str]) -> Worker | Verdict:
            if target is not None and target not in tried:
                worker = self._registry.get(target)
                if (
                    worker is not None
                    and worker.model == model
                    and worker.available(time.monotonic())
                ):
                    return worker
            return self._placer.any_worker(model, runtime, tried)

        return await self._dispatcher.forward(
            context,
            spec.path,
            request,
            meta.forward,
            pick,
            record,
            streaming=spec.server_streaming,
        )

    async def _fan_out(
        self, spec: RpcSpec, request: bytes, context: Context, record: CallRecord
    ) -> bytes:
        meta = self._meta(context)
        model = await self._model(context, meta, record)
        workers = self._placer.every_worker(model, self.adapter.runtime)
        if isinstance(workers, Verdict):
            await refuse(context, record, workers)
        record.workers = [w.id for w in workers]
        timeout = context.time_remaining()
        calls = [
            w.channel.unary_unary(spec.path)(request, metadata=meta.forward, timeout=timeout)
            for w in workers
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, aio.AioRpcError):
                await context.abort(
                    result.code(),
                    f"worker {worker.id}: {result.details()}",
                    clean(result.trailing_metadata()),
                )
            elif isinstance(result, BaseException):
                raise result
        await context.send_initial_metadata((("x-gateway-workers", ",".join(record.workers)),))
        return self.adapter.merge(spec.name, [r for r in results if isinstance(r, bytes)])

    async def _health_check(
        self, spec: RpcSpec, request: bytes, context: Context, record: CallRecord
    ) -> bytes:
        meta = self._meta(context)
        model = await self._model(context, meta, record)
        if self.draining:
            return self.adapter.health_check_reply(False, "the gateway is shutting down")
        if self._placer.servable(model, self.adapter.runtime):
            return self.adapter.health_check_reply(True, f"model '{model}' is servable")
        return self.adapter.health_check_reply(False, f"model '{model}' has no available workers")

    async def _abort_one(
        self, spec: RpcSpec, request: bytes, holder: Holder, meta: RequestMeta, context: Context
    ) -> bytes:
        """Abort one upstream call; a decode leg only once it has started (bounded), so the
        KV handoff from its prefill is not torn in the middle."""
        if holder.started is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.disagg.abort_wait_s):
                    await holder.started.wait()
        call = holder.worker.channel.unary_unary(spec.path)
        reply: bytes = await call(
            self.adapter.abort_request([holder.upstream_id], request),
            metadata=meta.forward,
            timeout=context.time_remaining(),
        )
        return reply

    async def _abort(
        self, spec: RpcSpec, request: bytes, context: Context, record: CallRecord
    ) -> bytes:
        try:
            ids = self.adapter.abort_ids(request)
        except DecodeError:
            await abort_invalid(context, "Request bytes are not a valid AbortRequest")
        record.request_id = ",".join(ids)
        holders = [h for request_id in ids for h in self._inflight.holders(request_id)]
        if not holders:
            unknown = ", ".join(repr(i) for i in ids)
            return self.adapter.abort_reply(False, f"request {unknown} is not in flight here")
        meta = self._meta(context)
        record.workers = [h.worker.id for h in holders]
        results = await asyncio.gather(
            *(self._abort_one(spec, request, h, meta, context) for h in holders),
            return_exceptions=True,
        )
        replies = [r for r in results if isinstance(r, bytes)]
        if not replies:
            failure = next(r for r in results if isinstance(r, BaseException))
            detail = failure.details() if isinstance(failure, aio.AioRpcError) else str(failure)
            return self.adapter.abort_reply(False, f"abort failed: {detail}")
        return self.adapter.merge_aborts(replies)
