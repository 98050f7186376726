"""What the API key tests share: a fake servicer context carrying a key and a peer (Context,
whose abort raises Aborted), a keys file (`keys_path`, a fixture, rewritten with
write_keys), an ApiKeyAuth over it with its counts and clock (auth_of), the error a refused
call raises (refused), and a health service guarded or not (health)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.config import AuthConfig
from gateway.security.auth import ApiKeyAuth
from gateway.security.keys import KeyFile
from gateway.services.health import SERVING, HealthService

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    """What the code under test asks of an aio.ServicerContext."""

    def __init__(self, key: str | None = None, peer: str = "ipv4:10.0.0.1:5555") -> None:
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def write_keys(path: Path, **keys: str) -> None:
    """Write the file and move its mtime on, so a change is seen whatever the clock tick."""
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text("".join(f"{name}:{key}\n" for name, key in keys.items()))
    os.utime(path, ns=(old + 10**9, old + 10**9))


@pytest.fixture
def keys_path(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    write_keys(path, alice=ALICE, bob=BOB)
    return path


# -- refusing, counting and logging ----------------------------------------------------


def auth_of(path: Path, limit: int = 3) -> tuple[ApiKeyAuth, list[str], list[float]]:
    counted: list[str] = []
    now = [100.0]
    config = AuthConfig(str(path), failure_limit=limit, failure_window_s=10, block_s=30)
    auth = ApiKeyAuth(KeyFile(str(path)), config, count=counted.append, clock=lambda: now[0])
    return auth, counted, now


async def refused(coro: Any) -> Aborted:
    with pytest.raises(Aborted) as caught:
        await coro
    return caught.value


# -- health: exposure and Watch bounds --------------------------------------------------


def health(max_watches: int = 1024, guarded: bool = False) -> tuple[HealthService, list[str]]:
    asked: list[str] = []

    async def guard(context: Any, method: str) -> None:
        asked.append(method)
        if context.invocation_metadata() == ():
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "key")

    service = HealthService(max_watches, guard if guarded else None)
    service.update({"": SERVING, "liveness": SERVING, "readiness": SERVING, "models/m": SERVING})
    return service, asked


def check(name: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=name)
