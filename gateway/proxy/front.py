"""The front: one servicer per engine protocol, built from the engine's service descriptor.

Every RPC of the service is served with raw-bytes handlers (nothing is decoded unless
routing needs it) and treated by its kind: placed and relayed (Generate, Embed), routed
by request id (Abort), answered from the gateway's state (HealthCheck), forwarded to one
worker (fleet-wide facts) or fanned out to all and merged (per-worker admin).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf.message import DecodeError

from gateway.config import DEFAULT_COST_TOKENS, GatewayConfig
from gateway.core.offload import Offload
from gateway.core.roles import Role
from gateway.engines import EngineAdapter, RpcKind, RpcSpec
from gateway.engines.base import SPLIT_MIN_BYTES, UsageBounds
from gateway.flow.budget import Charge, OverBudget, RateLimits
from gateway.kv.prefix import Prefix
from gateway.observability.logs import Throttle
from gateway.observability.record import CallRecord
from gateway.observability.tracing import TRACE_KEYS, CallTrace, Tracing
from gateway.placement.decision import Decision
from gateway.placement.placer import Placer
from gateway.placement.verdicts import (
    Verdict,
    bad_metadata,
    caller_over_share,
    gateway_overloaded,
    over_limit,
    rate_limited,
    shown,
)
from gateway.proxy.admission import Admission, Refusal
from gateway.proxy.call import Call, Context
from gateway.proxy.disagg import DisaggregatedDispatch
from gateway.proxy.dispatch import Dispatcher, Downstream, Job, answer, refuse
from gateway.proxy.idle import StreamIdle, idle_limit
from gateway.proxy.inflight import Holder
from gateway.proxy.intake import ReadGate, ReadTimeout, read_request
from gateway.proxy.metadata import Metadata, read_request_meta
from gateway.proxy.reporting import LoadTrailer, Reporting
from gateway.proxy.status import abort_invalid
from gateway.proxy.upstream import (
    CLIENT_DEADLINE_SLACK_S,
    Outbound,
    Reserved,
    UpstreamFailure,
)
from gateway.proxy.waiting import Place, WaitingRooms
from gateway.security.auth import Caller
from gateway.upstream.registry import Registry

log = structlog.get_logger("gateway.request")
# Request lines of calls refused UNAUTHENTICATED, per process: 10 a second after a burst
# of 20; the next line says how many were held back (every refusal is counted in
# gateway_auth_failures_total, and gateway.security.auth logs them by address).
REFUSED_LINES = Throttle(10.0, 20)

REGULAR_ONLY = (Role.REGULAR,)

Handler = Callable[[Call], Awaitable[Any]]


def peer_host(peer: str | None) -> str:
    """`ipv4:10.0.0.1:5555` -> `10.0.0.1`, `ipv6:[::1]:5555` -> `[::1]`: a client's
    connections share its host, whatever their ports."""
    if not peer:
        return "unknown"
    address = peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() else address


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


@dataclass(frozen=True, slots=True)
class Door:
    """What every engine call passes before it is placed (one of each per serving
    process, shared by its engine fronts): who sent it, the admission bounds, and the
    gate its request is read through; and what it leaves with: the process's load report
    on its trailers."""

    caller: Caller
    admission: Admission
    gate: ReadGate
    rates: RateLimits | None = None  # tenants' requests and tokens per minute
    load: LoadTrailer | None = None  # ORCA trailers on (see proxy/reporting.py)


@dataclass(frozen=True, slots=True)
class Routing:
    """Where a call goes and how it gets there: the workers, placement, the regular and
    the disaggregated dispatch, and the thread a long prompt is decoded and hashed in."""

    registry: Registry
    placer: Placer
    dispatcher: Dispatcher
    disagg: DisaggregatedDispatch
    offload: Offload
    rooms: WaitingRooms | None = None  # flow control: where busy models' calls wait


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
        self._observe = observe
        self._abort_path = next(
            spec.path for spec in adapter.rpcs.values() if spec.kind is RpcKind.ABORT
        )
        self._draining = False  # `drain()`: the engine HealthCheck then says unhealthy
        self._offload = routing.offload
        self._disagg = routing.disagg
        self._registry = routing.registry
        self._placer = routing.placer
        self._dispatcher = routing.dispatcher
        self._upstreams = routing.dispatcher.upstreams
        self._rooms = routing.rooms
        self._tracing = tracing
        self._request_lines = config.log_level in ("debug", "info")
        # With tracing on, the gateway continues the client's trace and sends workers its
        # own trace context: the client's is not forwarded as it is.
        private = door.caller.private_keys
        self._private_keys = private | TRACE_KEYS if tracing is not None else private
        flow = config.flow  # a call's output, when it does not say: estimated
        self._estimate = flow.cost_tokens if flow is not None else DEFAULT_COST_TOKENS

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

        admission, gate, limits = self._door.admission, self._door.gate, self._config.limits
        tracing = self._tracing
        retry_after_ms = self._config.retry_after_ms
        # The engine HealthCheck is answered from memory: it stays cheap and open under load.
        bounded = spec.kind is not RpcKind.HEALTH_CHECK
        streaming, idle_s = spec.server_streaming, limits.stream_idle_timeout_s
        read_s = limits.request_read_timeout_s
        load = self._door.load

        async def run(_requests: Any, context: Context) -> Any:
            reporting = None
            if load is not None:  # every way the call ends carries the load report
                context = reporting = Reporting(context, load)
            record = CallRecord(rpc=spec.name, service=self.adapter.service_name)
            admitted = False
            caller = ""
            trace = None
            if tracing is not None:  # the SERVER span: from the stream's opening
                trace = tracing.start(record, context.invocation_metadata(), context.peer())
            try:
                call = await self._open(spec, context, record, trace)
                caller = call.caller
                if bounded:  # from the stream's opening: streams that send nothing count
                    refusal = admission.enter(caller)
                    admitted = refusal is None
                    if refusal is Refusal.GATEWAY_FULL:  # this process's share (--processes)
                        await refuse(
                            context, record, gateway_overloaded(admission.limit, retry_after_ms)
                        )
                    if refusal is Refusal.CALLER_FULL:
                        verdict = caller_over_share(caller, admission.per_caller, retry_after_ms)
                        await refuse(context, record, verdict)
                deadline = asyncio.get_running_loop().time() + read_s
                try:
                    call.request = await read_request(context, gate, caller, deadline, read_s)
                except ReadTimeout as late:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED, str(late), (("x-http-status", "408"),)
                    )
                if not streaming:
                    return await serve(call)
                try:
                    async with idle_limit(record, idle_s):
                        return await serve(call)
                except StreamIdle as idle:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(idle))
            except asyncio.CancelledError:
                # The client went, or its deadline passed (grpc cancels the handler then).
                # The gateway's copy of the deadline started as the call arrived, a little
                # after the client's: a cancel within that slack of it is the deadline.
                left = context.time_remaining()
                expired = left is not None and left <= CLIENT_DEADLINE_SLACK_S
                record.code = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
                raise
            except BaseException:
                code = context.code()
                record.code = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                if reporting is not None:
                    reporting.end()
                if admitted:
                    admission.leave(caller)
                self._log(record, trace)

        return run

    async def _open(
        self, spec: RpcSpec, context: Context, record: CallRecord, trace: CallTrace | None
    ) -> Call:
        """The call as it opens: its metadata read once (the bearer token, the routing
        hints, what goes upstream); the caller authenticated (API keys on: a known key, or
        UNAUTHENTICATED) and named; a value no worker channel would accept refused
        (BAD_METADATA), before anything is read or placed."""
        config = self._config
        caller = self._door.caller
        meta = read_request_meta(
            context.invocation_metadata(),
            config.model_headers,
            config.routing_key_header,
            config.target_worker_header,
            self._private_keys,
            (config.flow.priority_header, config.flow.tenant_header) if config.flow else ("", ""),
        )
        record.peer = context.peer()
        principal = await caller.identify(context, meta.bearer, spec.path)
        record.principal = principal
        if meta.bad_key is not None:
            await refuse(context, record, bad_metadata(meta.bad_key))
        share = principal if principal is not None else "peer:" + peer_host(record.peer)
        return Call(spec, context, record, meta, share, trace=trace)

    def _log(self, record: CallRecord, trace: CallTrace | None = None) -> None:
        if trace is not None:
            trace.finish(record)
        self._observe(record)
        if not self._request_lines:  # below the log level: its fields are not even built
            return
        if record.code == "UNAUTHENTICATED":  # a client may send these at any rate
            record.suppressed = REFUSED_LINES.take()
            if record.suppressed is None:
                return
        log.info("request", **record.log_fields())

    async def _model(self, call: Call) -> str:
        """The model the call is for (named, or the protocol's only one), else refused."""
        named_model, record = call.meta.model, call.record
        resolved = self._placer.resolve(named_model, self.adapter.runtime)
        if isinstance(resolved, Verdict):
            record.model = named_model or ""
            await refuse(call.context, record, resolved)
        record.model = resolved
        return resolved

    def _job(self, call: Call, sink: Downstream | None = None) -> Job:
        sink = sink or Downstream(call.context, call.record)
        return Job(call, self.adapter, call.request, sink, call.record.request_id)

    async def _placed(self, call: Call) -> bytes | None:
        spec, request, context, record = call.spec, call.request, call.context, call.record
        if spec.kind is RpcKind.GENERATE:
            try:
                if len(request) < SPLIT_MIN_BYTES:
                    info = self.adapter.generate_info(request)
                else:  # a long prompt: its ids are decoded without the GIL, off the loop
                    info = await self._offload.run(self.adapter.generate_info, request)
            except DecodeError:
                await abort_invalid(context, "Request bytes are not a valid GenerateRequest")
            record.request_id = info.request_id
            limits = self._config.limits
            if info.n > limits.max_choices:
                verdict = over_limit(
                    "", "sampling_params.n", info.n, limits.max_choices, "limits.max_choices"
                )
                await refuse(context, record, verdict)
            if len(info.tokens) > limits.max_prompt_tokens:
                verdict = over_limit(
                    "",
                    "tokenized.input_ids",
                    len(info.tokens),
                    limits.max_prompt_tokens,
                    "limits.max_prompt_tokens",
                )
                await refuse(context, record, verdict)
        else:
            try:
                parsed: Any = spec.request_type.FromString(request)
            except DecodeError:
                await abort_invalid(context, f"Request bytes are not a valid {spec.name} request")
            record.prompt_tokens = len(parsed.tokenized.input_ids)
        meta = call.meta
        model = await self._model(call)
        runtime, placer, hints = self.adapter.runtime, self._placer, meta.hints
        items = info.mm_items if spec.kind is RpcKind.GENERATE else ()
        prefix = None
        if spec.kind is RpcKind.GENERATE:
            prefix = Prefix(info.tokens, info.namespace)
            hints = replace(hints, prefix=prefix)
            record.prompt_tokens = len(prefix)
        legs = placer.legs(model, bool(items))
        if prefix is not None:  # hashed ahead, off the loop for long prompts (cache_aware)
            await prefix.prepare(placer.block_sizes(model, runtime, legs), self._offload)

        def place(tried: Collection[str]) -> Decision | Verdict:
            return placer.place(model, runtime, hints, items, tried, legs)

        def place_receiver(tried: Collection[str]) -> Decision | Verdict:
            decided = place(tried)
            return decided if isinstance(decided, Verdict) else decided.only(decided.receiver)

        generating = spec.kind is RpcKind.GENERATE
        n = info.n if generating else 1
        # Its cost in tokens: the prompt, plus what its choices may generate.
        output = (info.max_new_tokens or self._estimate) * n if generating else 0
        cost = record.prompt_tokens + output
        who = self._classify(call)
        tenant = who[0]
        charge = await self._charge(call, model, tenant, cost)
        tally = None
        if generating:
            most = info.max_new_tokens or self._config.limits.max_completion_tokens
            bounds = UsageBounds(completion_tokens=n * most, cached_tokens=record.prompt_tokens)
            tally = self.adapter.tally(info.stream, n, bounds)
        sink = Downstream(context, record, tally)
        job = self._job(call, sink)
        first: Reserved | None = None
        try:
            run: Awaitable[bytes | None]
            if generating and legs != REGULAR_ONLY:
                job = replace(job, return_logprob=info.return_logprob)
                if n == 1:  # n > 1: each choice is placed on its own pair, at once
                    first = await self._wait(call, model, who, cost, lambda: place(()))
                run = self._disagg.serve(job, n, place, first)
            else:
                first = await self._wait(call, model, who, cost, lambda: place_receiver(()))
                flow = self._dispatcher.flow(spec.server_streaming)
                run = self._dispatcher.serve(job, place_receiver, flow, first)
            return await run
        finally:
            sink.tally()
            if first is not None:
                first.release_unused()  # the run's own (a no-op), unless it never started
                if self._rooms is not None:  # its tenant may run another
                    self._rooms.done(tenant)
            if charge is not None:
                self._settle(charge, record)

    def _classify(self, call: Call) -> tuple[str, int]:
        """Whose budget and queue share the call uses (its principal: an API key's name, a
        client certificate's identity; the tenant header behind a trusted proxy; else
        `default`) and its class with flow control (the one it asks for, lowered to its
        tenant's `max_class`); both go into the record when flow control or rate limits
        are on."""
        flow, record = self._config.flow, call.record
        asked_class, asked_tenant = call.meta.flow
        if flow is not None and flow.trust_tenant_header and asked_tenant:
            tenant = shown(asked_tenant)
        elif record.principal is not None:  # `key:NAME` or `cert:NAME`: the tenant NAME
            tenant = record.principal.partition(":")[2]
        else:
            tenant = "default"
        if flow is None:
            if self._door.rates is not None:
                record.tenant = tenant
            return tenant, 0
        klass = flow.index(asked_class) if asked_class is not None else None
        if klass is None:
            klass = flow.index(flow.default_class)
        assert klass is not None
        cap = self._config.tenant(tenant).max_class
        ceiling = flow.index(cap) if cap is not None else None
        if ceiling is not None and klass < ceiling:
            klass, record.lowered = ceiling, True
        record.tenant, record.priority = tenant, flow.classes[klass].name
        return tenant, klass

    async def _charge(self, call: Call, model: str, tenant: str, tokens: int) -> Charge | None:
        """Taken from the tenant's rate limits (its tokens reserved), else RATE_LIMITED
        with the time its budget allows the call. None: the tenant has no rate limits."""
        rates = self._door.rates
        if rates is None:
            return None
        taken = rates.take(tenant, tokens, time.monotonic())
        if isinstance(taken, OverBudget):
            wait_ms = math.ceil(taken.wait_s * 1000)
            verdict = rate_limited(model, tenant, taken.budget, taken.per_minute, wait_ms)
            await refuse(call.context, call.record, verdict)
        return taken

    def _settle(self, charge: Charge, record: CallRecord) -> None:
        """The call ended: its tenant pays what it used (all back if no worker saw it)."""
        assert self._door.rates is not None
        used = record.prompt_tokens + (record.completion_tokens or 0) if record.attempts else None
        self._door.rates.settle(charge, used, time.monotonic())

    async def _wait(
        self, call: Call, model: str, who: tuple[str, int], cost: int, place: Place
    ) -> Reserved | None:
        """With flow control: placed and reserved now or once capacity frees (waiting in
        the model's queue), else refused (QUEUE_FULL, QUEUE_TIMEOUT, or the verdict of a
        model that cannot be placed at all). None: no flow control."""
        rooms, flow = self._rooms, self._config.flow
        if rooms is None or flow is None:
            return None
        record, (tenant, klass) = call.record, who
        started, started_ns = time.monotonic(), time.time_ns()
        try:
            got = await rooms.admit(model, tenant, klass, cost, len(call.request), place)
        finally:  # also when the client left, or its deadline passed, while it waited
            record.queued_s = round(time.monotonic() - started, 6)
        if isinstance(got, Verdict):
            if call.trace is not None:
                call.trace.placement(started_ns, got, queued_s=record.queued_s)
            await refuse(call.context, record, got)
        try:
            if call.trace is not None:
                call.trace.placement(started_ns, got.decision, queued_s=record.queued_s)
        except BaseException:  # nothing runs it: the workers and the tenant's slot go back
            got.release_unused()
            rooms.done(tenant)
            raise
        return got

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

        flow = self._dispatcher.flow(call.spec.server_streaming)
        return await self._dispatcher.serve(self._job(call), pick, flow)

    async def _fan_out(self, call: Call) -> bytes:
        spec, request, context, record, meta = (
            call.spec, call.request, call.context, call.record, call.meta
        )  # fmt: skip
        model = await self._model(call)
        workers = self._placer.every_worker(model, self.adapter.runtime)
        if isinstance(workers, Verdict):
            await refuse(context, record, workers)
        record.targets = [w.id for w in workers]
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
                await answer(context, result)
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
        record: CallRecord | None = None,
    ) -> bytes | None:
        """Abort what this process holds of `ids` for `principal`: the merged engine reply,
        or None if it holds none of them (the peer service asks the same of siblings)."""
        holders, _ = self._held(ids, principal)
        return await self._abort_holders(request, holders, forward, time_left, record)

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
        record: CallRecord | None,
    ) -> bytes | None:
        if not holders:
            return None
        if record is not None:
            record.targets = [h.worker.id for h in holders]
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
        record.request_id = ",".join(ids)
        principal, forward = record.principal, call.meta.forward
        timeout = context.time_remaining()
        holders, all_here = self._held(ids, principal)  # before any await
        local = await self._abort_holders(request, holders, forward, timeout, record)
        replies = [local] if local is not None else []
        if self._siblings is not None and not all_here:
            # Some named request runs elsewhere (a vLLM Abort may name several): the
            # siblings abort what they hold of them, nothing this process holds.
            remote = await self._siblings.abort_held(
                self.adapter.service_name, request, principal, forward, timeout
            )
            if remote:
                record.targets = [*(record.targets or []), "sibling process"]
            replies += remote
        if not replies:
            return self.adapter.abort_reply(False, f"request {named(ids)} is not in flight here")
        return replies[0] if len(replies) == 1 else self.adapter.merge_aborts(replies)
