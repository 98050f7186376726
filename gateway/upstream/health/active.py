"""Active probes: grpc.health.v1 Check with the engine's service name, at an interval.

Falls back to the engine's own HealthCheck RPC only where grpc.health is unimplemented
(SGLang's runs a real generation, so it is the expensive choice). Probing never stops:
there is no terminal state a worker needs a restart to leave.

What a probe can say about the worker is a verdict: an answer (SERVING, NOT_SERVING), an
RPC error or timeout, an answer that does not decode. Any other exception is the
gateway's own bug, not the worker's: it is logged with its traceback (once while it
repeats) and the probe's result is `ProbeKind.INTERNAL`, which `judge` does not count.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import health_pb2

from gateway.config import ProbeConfig
from gateway.core import health
from gateway.core.roles import Role
from gateway.engines import EngineAdapter
from gateway.engines.encoder import SERVICE_NAME as ENCODER_SERVICE
from gateway.upstream import stagger
from gateway.upstream.signals.probe import ProbeKind, ProbeResult
from gateway.upstream.worker import Worker

SERVING = health_pb2.HealthCheckResponse.SERVING

log = structlog.get_logger("gateway.upstream")


async def probe_once(
    worker: Worker,
    channel: aio.Channel,
    adapter: EngineAdapter,
    settings: ProbeConfig,
    engine_rpc: bool,
) -> ProbeResult:
    """One probe's verdict (`adapter`: the worker's engine protocol). An exception other
    than an RPC error or an undecodable answer (a bug in the gateway) is raised, never
    turned into a verdict about the worker."""
    try:
        if engine_rpc:
            raw = await channel.unary_unary(adapter.path("HealthCheck"))(
                b"", timeout=settings.timeout_s
            )
            healthy, message = adapter.health_check_answer(raw)
            kind = ProbeKind.SERVING if healthy else ProbeKind.NOT_SERVING
            return ProbeResult(kind, f"HealthCheck healthy={healthy} {message}".strip())
        # Raw bytes, decoded here: grpc's own deserializer would log and return None.
        check = channel.unary_unary(
            health.CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        )
        service = ENCODER_SERVICE if worker.role is Role.ENCODE else adapter.service_name
        raw = await check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=settings.timeout_s,
        )
        reply = health_pb2.HealthCheckResponse.FromString(raw)
    except aio.AioRpcError as error:
        if error.code() is grpc.StatusCode.NOT_FOUND and not engine_rpc:
            return ProbeResult(ProbeKind.NOT_SERVING, "grpc.health: service unknown")
        return ProbeResult(ProbeKind.ERROR, f"{error.code().name}: {error.details()}")
    except DecodeError as error:  # an answer that does not decode is a failed probe too
        return ProbeResult(ProbeKind.ERROR, f"bad answer: {error!r}")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    kind = ProbeKind.SERVING if reply.status == SERVING else ProbeKind.NOT_SERVING
    return ProbeResult(kind, f"grpc.health {name}")


class ProbeLoop:
    """One worker's probe loop (`adapter`: its engine protocol); `wake()` runs the next
    probe now (e.g. on reconnect). Its first wait is a random part of the interval, so
    workers that joined together are not probed together (gateway/upstream/stagger.py)."""

    def __init__(
        self, worker: Worker, channel: aio.Channel, adapter: EngineAdapter, settings: ProbeConfig
    ) -> None:
        self.worker = worker
        self.channel = channel
        self.adapter = adapter
        self.settings = settings
        self._wake = asyncio.Event()
        self._waits = stagger.waits(settings.interval_s)
        self._engine_rpc = False  # switched on once grpc.health says UNIMPLEMENTED
        self._bug = ""  # the last internal error logged: logged again once it changes

    def wake(self) -> None:
        self._wake.set()

    async def next_result(self) -> ProbeResult:
        """Wait for the interval (or a wake-up), then probe once."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(next(self._waits)):
                await self._wake.wait()
        self._wake.clear()
        return await self.probe()

    async def probe(self) -> ProbeResult:
        try:
            result = await probe_once(
                self.worker, self.channel, self.adapter, self.settings, self._engine_rpc
            )
            if not self._engine_rpc and result.detail.startswith("UNIMPLEMENTED"):
                self._engine_rpc = True
                result = await probe_once(
                    self.worker, self.channel, self.adapter, self.settings, True
                )
        except Exception as error:
            result = self._internal(error)
        else:
            self._bug = ""
        return dataclasses.replace(result, at=time.time())  # the state is the worker's

    def _internal(self, error: Exception) -> ProbeResult:
        """A bug in the probe (the gateway's, not the worker's): logged at error level with
        its traceback, once while the same error repeats; no verdict about the worker."""
        detail = f"gateway error (not a verdict on the worker): {error!r}"
        if repr(error) != self._bug:
            self._bug = repr(error)
            log.exception("probe_internal_error", worker=self.worker.id, error=repr(error))
        return ProbeResult(ProbeKind.INTERNAL, detail)
