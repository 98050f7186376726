"""The gateway's own grpc.health.v1 service.

For now the stock servicer with "" SERVING while the process runs; the availability
work replaces it with one driven by fleet events (readiness, per-model, per-protocol).
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2


def make_health_servicer() -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, name: str, serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    await servicer.set(name, status)
