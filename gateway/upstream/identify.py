"""Ask a worker what it is when the configuration does not say: its runtime and its model."""

from __future__ import annotations

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2

from gateway.core import health
from gateway.core.roles import Runtime
from gateway.engines import Adapters, EngineAdapter
from gateway.engines.base import ModelFacts, ServerFacts


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
