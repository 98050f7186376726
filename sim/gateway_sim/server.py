"""Process wiring of the simulated worker: gRPC server, health, signals, READY line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gateway_sim.config import SimConfig
from gateway_sim.engine import SimEngine
from gateway_sim.lines import LineServer
from gateway_sim.roles import wire

log = logging.getLogger("gateway_sim")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SHUTDOWN_GRACE_S = 1.0
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Accept the gateway's keepalive pings while a call is silent (a long prefill), as an
    # engine behind the gateway must: grpc's default answers pings more often than every
    # 5 minutes on a connection that sends nothing with GOAWAY "too_many_pings". The key
    # is grpc core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, whose string
    # has no "recv" (a key spelt with it is silently ignored).
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
)


class EngineHealth(health_aio.HealthServicer):  # type: ignore[misc]
    """grpc.health as the servicers answer it: an unknown service is NOT_FOUND, the
    message naming it."""

    async def Check(self, request: Any, context: Any) -> Any:
        if request.service not in self._server_status:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"Unknown service: {request.service}")
        return await super().Check(request, context)


class SlowHealth(EngineHealth):
    """grpc.health whose Check answers late (`delay_s`) or never (None): a wedged worker."""

    def __init__(self, delay_s: float | None) -> None:
        super().__init__()
        self._delay_s = delay_s

    async def Check(self, request: Any, context: Any) -> Any:
        if self._delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self._delay_s or 0.0)
        return await super().Check(request, context)


class HealthSwitch:
    """Flips grpc.health and the engine's own HealthCheck together (SIGUSR1/SIGUSR2)."""

    def __init__(
        self,
        engine: SimEngine,
        health: health_aio.HealthServicer | None,
        service_name: str,
    ) -> None:
        self._engine = engine
        self._health = health
        self._services = ("", service_name)

    async def set(self, serving: bool) -> None:
        self._engine.healthy = serving
        if self._health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in self._services:
            await self._health.set(service, status)


def _configure_logging(level: str) -> None:
    """Log to stderr on our own logger, leaving the embedding CLI's logging alone."""
    log.setLevel(level.upper())
    if not any(getattr(h, "_sim", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s sim %(levelname)s %(message)s"))
        handler._sim = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.propagate = False


def _print_ready(port: int, side_ports: Mapping[str, int]) -> None:
    """``READY <port>`` then ``name=<port>`` per side server (bootstrap, embedding, kv):
    the launcher reads those into ``Child.extra``."""
    words = [f"READY {port}", *(f"{name}={side}" for name, side in side_ports.items())]
    print(" ".join(words), flush=True)


async def _start_side(servers: list[LineServer]) -> dict[str, int]:
    """Start the role's TCP side servers; SystemExit if one cannot listen (``serve``
    closes those already started)."""
    ports: dict[str, int] = {}
    for side in servers:
        try:
            ports[side.label] = await side.start()
        except OSError as exc:
            raise SystemExit(
                f"sim: cannot listen for {side.label} on {side.host}:{side.port}: {exc}"
            ) from exc
    return ports


async def _close_side(servers: list[LineServer]) -> None:
    for side in servers:
        await side.close()


def _credentials(config: SimConfig) -> grpc.ServerCredentials | None:
    """TLS for a `grpcs://` worker (mTLS with a client CA), from PEM files."""
    if not (config.tls_cert and config.tls_key):
        return None
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
        Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None,
        require_client_auth=config.tls_client_ca is not None,
    )


async def serve(
    config: SimConfig,
    ready: Callable[[int, Mapping[str, int]], None] = _print_ready,
) -> None:
    """Serve until SIGTERM/SIGINT (or cancellation), then stop with a 1 s grace."""
    _configure_logging(config.log_level)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    try:
        credentials = _credentials(config)
        if credentials is None:
            port = server.add_insecure_port(config.listen)
        else:
            port = server.add_secure_port(config.listen, credentials)
    except RuntimeError as exc:
        raise SystemExit(f"sim: cannot listen on {config.listen}: {exc}") from exc
    if port == 0:
        raise SystemExit(f"sim: cannot listen on {config.listen}")

    engine = SimEngine(config.worker_name(port), config)
    wiring = wire(engine)
    wiring.register(server)
    service_name = wiring.service_name

    health: health_aio.HealthServicer | None = None
    services = [service_name, reflection.SERVICE_NAME]
    if config.grpc_health:
        health = SlowHealth(config.health_delay_s) if config.health_delay_s != 0 else None
        health = health or EngineHealth()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        services.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    # Reflection lets grpcurl talk to a sim worker in demos without .proto files.
    reflection.enable_server_reflection(services, server)

    switch = HealthSwitch(engine, health, service_name)
    await switch.set(not config.not_serving)

    # What the signals ask, in order: a health flip (serving or not), or None: stop. Served
    # here, one after another, by serve itself (no task).
    asked: asyncio.Queue[bool | None] = asyncio.Queue()

    def flip(serving: bool) -> None:
        log.info("%s: health -> %s", engine.name, "SERVING" if serving else "NOT_SERVING")
        asked.put_nowait(serving)

    handlers: dict[signal.Signals, Callable[[], None]] = {
        signal.SIGUSR1: lambda: flip(False),
        signal.SIGUSR2: lambda: flip(True),
        signal.SIGTERM: lambda: asked.put_nowait(None),
        signal.SIGINT: lambda: asked.put_nowait(None),
    }
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for signum, handler in handlers.items():
        try:
            loop.add_signal_handler(signum, handler)
            installed.append(signum)
        except (NotImplementedError, RuntimeError, ValueError):
            log.warning("cannot handle %s here (not the main thread?)", signum.name)

    try:
        side_ports = await _start_side(wiring.side_servers)
        await server.start()
        ready(port, side_ports)
        log.info(
            "%s: serving %s (%s) on port %d %s",
            engine.name,
            service_name,
            config.role,
            port,
            side_ports,
        )
        while (serving := await asked.get()) is not None:
            await switch.set(serving)
        log.info("%s: stopping", engine.name)
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
        if health is not None:
            await health.enter_graceful_shutdown()
        try:
            await server.stop(SHUTDOWN_GRACE_S)
        finally:
            await _close_side(wiring.side_servers)


async def run_sim(args: argparse.Namespace) -> None:
    """Entry point for ``gateway sim`` and ``gateway-sim`` (``python -m gateway_sim``)."""
    await serve(SimConfig.from_args(args))
