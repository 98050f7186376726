"""An in-process admin server for the admin tests: a real Fleet (no workers to start with),
the admin server on 127.0.0.1:0, the generated stub over grpc.aio (`admin`, a fixture); and
a port nothing listens on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from grpc import aio

from gateway.admin.service import AdminService, start_admin_server
from gateway.admin.v1 import admin_pb2_grpc
from gateway.config import build_config
from gateway.engines import engine_adapters
from gateway.placement.policies import build_policy
from gateway.upstream.manager import Fleet

TOKEN = "s3cret"


@dataclass
class Admin:
    fleet: Fleet
    server: aio.Server
    service: AdminService
    port: int
    channel: aio.Channel
    stub: Any  # admin_pb2_grpc.AdminServiceStub (untyped generated code)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start(token: str | None = None) -> Admin:
    config = build_config(
        overrides={
            "admin.listen": "127.0.0.1:0",
            "admin.token": token,
            "discovery_timeout_s": 0.5,
        }
    )
    fleet = Fleet(config, engine_adapters(), build_policy)
    await fleet.start(())
    server, port, service = await start_admin_server(fleet, config)
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    return Admin(fleet, server, service, port, channel, admin_pb2_grpc.AdminServiceStub(channel))


async def stop(admin: Admin) -> None:
    await admin.channel.close()
    await admin.server.stop(None)
    await admin.service.close()
    await admin.fleet.close()


@pytest.fixture
async def admin() -> AsyncIterator[Admin]:
    started = await start()
    yield started
    await stop(started)
