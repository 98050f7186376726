"""Assembles the gateway: fleet -> placement -> dispatch, fronted by the engine servicers."""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog
from grpc import aio
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.config import GatewayConfig
from gateway.engines import ADAPTERS
from gateway.fleet.fleet import Fleet
from gateway.health import make_health_servicer, set_serving
from gateway.placement.placer import Placer
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.front import EngineFront
from gateway.proxy.inflight import InflightTable

log = structlog.get_logger("gateway")

HEALTH_SERVICE = "grpc.health.v1.Health"
SHUTDOWN_GRACE_S = 5.0


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.fleet = Fleet(config.max_message_bytes, config.discovery_timeout_s)
        self.inflight = InflightTable()
        self.placer = Placer(self.fleet.registry, config.policy_for, config.retry_after_ms)
        self.dispatcher = Dispatcher(self.inflight, config.max_attempts)
        self.health = make_health_servicer()
        self.server = aio.server(
            options=[
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        self.port = 0

    async def start(self) -> int:
        fronts = [
            EngineFront(
                adapter,
                self.config,
                self.fleet.registry,
                self.placer,
                self.dispatcher,
                self.inflight,
            )
            for adapter in ADAPTERS.values()
        ]
        self.server.add_generic_rpc_handlers(tuple(front.handler() for front in fronts))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [a.service_name for a in ADAPTERS.values()] + [HEALTH_SERVICE, reflection.SERVICE_NAME],
            self.server,
        )
        self.port = self.server.add_insecure_port(self.config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.config.listen}")
        await self.fleet.start(self.config.workers)
        await self.server.start()
        await set_serving(self.health, "", True)
        log.info(
            "serving", listen=self.config.listen, port=self.port, workers=len(self.fleet.registry)
        )
        return self.port

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        await set_serving(self.health, "", False)
        await self.server.stop(grace)
        await self.fleet.close()


async def serve(config: GatewayConfig) -> None:
    gateway = Gateway(config)
    port = await gateway.start()
    host = config.listen.rpartition(":")[0]
    print(f"READY {host}:{port}", flush=True)  # the line scripts and tests wait for
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await gateway.stop()
    sys.stdout.flush()
