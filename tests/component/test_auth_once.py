"""An engine call's API key is looked up once: the front reads the call's metadata once
(bearer token, routing hints, what goes upstream) and authenticates from it; the
interceptor leaves the engine services to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.app.server import Gateway
from gateway.security.auth import MISSING_KEY, REJECTED_KEY
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.inproc import client, gateway, idle, sim

KEY = "alice-key-0123456789"


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[Gateway]:
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KEY}\n")
    settings: dict[str, Any] = {"auth.api_keys_file": str(keys)}
    async with (
        sim("--model", "m") as worker,
        gateway(worker.url(model="m", runtime="sglang"), **settings) as gw,
    ):
        yield gw


def count_lookups(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    assert gw.parts.auth is not None
    keys = gw.parts.auth.keys
    looked: list[Any] = []
    original = keys.name_of

    def name_of(given: str | None) -> str | None:
        looked.append(given)
        return original(given)

    monkeypatch.setattr(keys, "name_of", name_of)
    return looked


async def test_a_call_with_a_key_is_looked_up_once(
    keyed: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked = count_lookups(keyed, monkeypatch)
    async with client(keyed) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("once", 2), metadata=model_md("m", ("authorization", f"Bearer {KEY}"))
        )
        messages, error = await collect(call)
    assert error is None and messages
    assert looked == [KEY]
    await idle(keyed)


@pytest.mark.parametrize(
    ("extra", "message", "lookups"),
    [((), MISSING_KEY, 0), ((("authorization", "Bearer nope"),), REJECTED_KEY, 1)],
)
async def test_a_call_without_a_known_key_is_refused_by_the_front(
    keyed: Gateway,
    monkeypatch: pytest.MonkeyPatch,
    extra: tuple[tuple[str, str], ...],
    message: str,
    lookups: int,
) -> None:
    looked = count_lookups(keyed, monkeypatch)
    async with client(keyed) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("no", 2), metadata=model_md("m", *extra)
        )
        _, error = await collect(call)
    assert error is not None
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
    assert len(looked) == lookups
    await idle(keyed)
