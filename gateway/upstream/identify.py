"""Ask a worker what it is when the configuration does not say: its runtime and its model
(`discover`: every question a joining worker is asked, from the questions below)."""

from __future__ import annotations

import grpc
import structlog
from grpc import aio
from grpc_health.v1 import health_pb2

from gateway.config import WorkerSpec
from gateway.core import health
from gateway.core.roles import Role, Runtime
from gateway.engines import Adapters, EngineAdapter, encoder
from gateway.engines.base import ModelFacts, ServerFacts

log = structlog.get_logger("gateway.upstream")


class DiscoveryError(Exception):
    """The worker could not be asked, or answered as no known engine."""


async def _speaks(channel: aio.Channel, adapter: EngineAdapter, call_timeout: float) -> bool:
    """grpc.health knows the engine's service name; else an engine RPC is not UNIMPLEMENTED."""
    check = channel.unary_unary(
        health.CHECK,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    try:
        await check(
            health_pb2.HealthCheckRequest(service=adapter.service_name), timeout=call_timeout
        )
        return True
    except aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.NOT_FOUND:
            return False
        if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
            raise DiscoveryError(
                f"health check failed: {exc.code().name}: {exc.details()}"
            ) from None
    try:
        await channel.unary_unary(adapter.path("GetModelInfo"))(b"", timeout=call_timeout)
        return True
    except aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
            return False
        raise DiscoveryError(f"GetModelInfo failed: {exc.code().name}: {exc.details()}") from None


async def detect_runtime(channel: aio.Channel, adapters: Adapters, call_timeout: float) -> Runtime:
    """The first of `adapters`' engine protocols the worker speaks."""
    for runtime, adapter in adapters.items():
        if await _speaks(channel, adapter, call_timeout):
            return runtime
    raise DiscoveryError("serves neither SglangScheduler nor VllmEngine")


async def _model_info(
    channel: aio.Channel, adapter: EngineAdapter, call_timeout: float
) -> ModelFacts:
    """What the worker's GetModelInfo says, as facts."""
    try:
        info = await channel.unary_unary(adapter.path("GetModelInfo"))(b"", timeout=call_timeout)
    except aio.AioRpcError as exc:
        raise DiscoveryError(f"GetModelInfo failed: {exc.code().name}: {exc.details()}") from None
    return adapter.model_facts(info)


async def model_facts(
    channel: aio.Channel, adapter: EngineAdapter, call_timeout: float
) -> ModelFacts:
    """The model the worker serves (raises DiscoveryError when it names none) and its
    vocabulary."""
    facts = await _model_info(channel, adapter, call_timeout)
    if not facts.name:
        raise DiscoveryError("GetModelInfo names no model (served_model_name and model_path empty)")
    return facts


async def server_facts(
    channel: aio.Channel, adapter: EngineAdapter, call_timeout: float
) -> ServerFacts:
    """A worker's disaggregation role and rendezvous facts; an unanswered question is not an
    error (older workers have no such fields), a refused connection is."""
    try:
        info = await channel.unary_unary(adapter.path("GetServerInfo"))(b"", timeout=call_timeout)
    except aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
            return ServerFacts(role=None)
        raise DiscoveryError(f"GetServerInfo failed: {exc.code().name}: {exc.details()}") from None
    return adapter.server_facts(info)


async def vocabulary(
    channel: aio.Channel, adapter: EngineAdapter, call_timeout: float
) -> int | None:
    """The worker's vocabulary size (0: it does not say; None: it did not answer, ask
    again later): the bound on the token ids placement lets through to it."""
    try:
        return (await _model_info(channel, adapter, call_timeout)).vocab_size or 0
    except DiscoveryError:
        return None


async def discover(
    spec: WorkerSpec, channel: aio.Channel, adapters: Adapters, call_timeout: float
) -> tuple[Runtime, str, ServerFacts, int | None]:
    """Runtime, model, (for disaggregated roles) the GetServerInfo facts, and the
    vocabulary size when GetModelInfo was asked."""
    if spec.role is Role.ENCODE:
        # Encoders speak their own protocol only: nothing to ask, the URL names the model.
        runtime = spec.runtime or encoder.RUNTIME
        return runtime, spec.model or "", ServerFacts(Role.ENCODE), None
    discovering = spec.runtime is None or spec.model is None
    runtime = spec.runtime or await detect_runtime(channel, adapters, call_timeout)
    adapter = adapters[runtime]
    vocab_size: int | None
    if spec.model is None:
        asked = await model_facts(channel, adapter, call_timeout)
        model, vocab_size = asked.name, asked.vocab_size or 0
    else:  # its vocabulary: now if it answers, else by the load loop once it does
        model, vocab_size = spec.model, await vocabulary(channel, adapter, call_timeout)
    # A URL naming model and runtime but no role means a regular worker: registering
    # it does not wait on a worker that is down (its block size is then not known).
    # Disaggregated roles are asked for their bootstrap port and pairing key, and
    # every worker for its KV block size, best effort.
    try:
        facts = await server_facts(channel, adapter, call_timeout)
    except DiscoveryError as exc:
        if spec.role is None and discovering:
            raise
        if spec.role in (Role.PREFILL, Role.DECODE):
            log.warning("server_info_failed", worker=spec.address, error=str(exc))
        facts = ServerFacts(role=None)
    return runtime, model, facts, vocab_size
