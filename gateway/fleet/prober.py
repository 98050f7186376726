"""Active probes: grpc.health.v1 Check with the engine's service name, at an interval.

Falls back to the engine's own HealthCheck RPC only where grpc.health is unimplemented
(SGLang's runs a real generation, so it is the expensive choice). Probing never stops:
there is no terminal state a worker needs a restart to leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2

from gateway.config import ProbeConfig
from gateway.engines import ADAPTERS
from gateway.engines.encoder import SERVICE_NAME as ENCODER_SERVICE
from gateway.fleet.probe import ProbeKind, ProbeResult
from gateway.fleet.worker import Worker
from gateway.roles import Role

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = health_pb2.HealthCheckResponse.SERVING


async def probe_once(worker: Worker, settings: ProbeConfig, engine_rpc: bool) -> ProbeResult:
    adapter = ADAPTERS[worker.runtime]
    try:
        if engine_rpc:
            raw = await worker.channel.unary_unary(adapter.path("HealthCheck"))(
                b"", timeout=settings.timeout_s
            )
            healthy, message = adapter.health_check_answer(raw)
            kind = ProbeKind.SERVING if healthy else ProbeKind.NOT_SERVING
            return ProbeResult(kind, f"HealthCheck healthy={healthy} {message}".strip())
        check = worker.channel.unary_unary(
            HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        service = ENCODER_SERVICE if worker.role is Role.ENCODE else adapter.service_name
        reply = await check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=settings.timeout_s,
        )
    except aio.AioRpcError as error:
        if error.code() is grpc.StatusCode.NOT_FOUND and not engine_rpc:
            return ProbeResult(ProbeKind.NOT_SERVING, "grpc.health: service unknown")
        return ProbeResult(ProbeKind.ERROR, f"{error.code().name}: {error.details()}")
    except Exception as error:  # an answer that does not decode is a failed probe too
        return ProbeResult(ProbeKind.ERROR, f"bad answer: {error!r}")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    kind = ProbeKind.SERVING if reply.status == SERVING else ProbeKind.NOT_SERVING
    return ProbeResult(kind, f"grpc.health {name}")


class ProbeLoop:
    """One worker's probe loop; `wake()` runs the next probe now (e.g. on reconnect)."""

    def __init__(self, worker: Worker, settings: ProbeConfig) -> None:
        self.worker = worker
        self.settings = settings
        self._wake = asyncio.Event()
        self._engine_rpc = False  # switched on once grpc.health says UNIMPLEMENTED

    def wake(self) -> None:
        self._wake.set()

    async def next_result(self) -> ProbeResult:
        """Wait for the interval (or a wake-up), then probe once."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.interval_s):
                await self._wake.wait()
        self._wake.clear()
        return await self.probe()

    async def probe(self) -> ProbeResult:
        result = await probe_once(self.worker, self.settings, self._engine_rpc)
        if not self._engine_rpc and result.detail.startswith("UNIMPLEMENTED"):
            self._engine_rpc = True
            result = await probe_once(self.worker, self.settings, True)
        self.worker.probe.last_at = time.time()
        return result
