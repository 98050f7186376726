"""A worker that takes Generate calls and holds them without reading their request:
`python -m tests.e2e.sink_worker`, prints `READY 127.0.0.1:PORT`. It stands for a busy
engine in tests that measure the gateway alone (the simulator would spend a core on a
long prompt's prefix cache, on the same 2-core machine)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVICE = "sglang.grpc.scheduler.SglangScheduler"


async def hold(_request: bytes, context: aio.ServicerContext) -> Any:
    await asyncio.sleep(3600)


async def main() -> None:
    server = aio.server(options=[("grpc.max_receive_message_length", 256 << 20)])
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(hold)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    checks = health.aio.HealthServicer()
    await checks.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
