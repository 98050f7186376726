"""OpenRcaService/StreamCoreMetrics streams are shared out: one client connection holds
at most `orca.max_streams_per_connection`, one principal (API key; else the peer's
address) at most `orca.max_streams_per_peer`; past either, RESOURCE_EXHAUSTED naming the
share, counted in `gateway_orca_streams_refused_total`; every count is back to zero
when the streams end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from gateway.app.server import Gateway
from gateway.orca.v3 import orca_pb2, orca_pb2_grpc
from gateway_sim.client import collect
from tests.support.inproc import gateway, sim
from tests.support.waits import until

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789ab"


@contextlib.asynccontextmanager
async def connection(gw: Gateway) -> AsyncIterator[aio.Channel]:
    """A channel on a client connection of its own (grpc shares one between channels to
    the same address otherwise)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with aio.insecure_channel(f"127.0.0.1:{gw.port}", options=options) as channel:
        yield channel


async def open_stream(channel: aio.Channel, key: str | None = None) -> Any:
    """A stream that got its first report (still open)."""
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    call = orca_pb2_grpc.OpenRcaServiceStub(channel).StreamCoreMetrics(
        orca_pb2.OrcaLoadReportRequest(), metadata=metadata
    )
    assert await call.read() is not aio.EOF
    return call


async def refusal(channel: aio.Channel, key: str | None = None) -> str:
    """The message of a stream refused RESOURCE_EXHAUSTED."""
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    stub = orca_pb2_grpc.OpenRcaServiceStub(channel)
    reports, error = await collect(
        stub.StreamCoreMetrics(orca_pb2.OrcaLoadReportRequest(), metadata=metadata)
    )
    assert not reports and error is not None
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    return str(error.details())


def refused(gw: Gateway, share: str) -> float | None:
    sample = gw.parts.metrics.prometheus.get_sample_value
    return sample("gateway_orca_streams_refused_total", {"share": share})


async def test_a_connection_and_a_peer_address_each_hold_a_share_of_the_streams() -> None:
    shares: dict[str, Any] = {
        "orca.max_streams_per_connection": 2,
        "orca.max_streams_per_peer": 3,
    }
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), **shares) as gw,
        connection(gw) as first,
        connection(gw) as second,
    ):
        held = [await open_stream(first), await open_stream(first)]
        assert "orca.max_streams_per_connection: 2" in await refusal(first)
        held.append(await open_stream(second))  # another connection: its own share
        # ... but the same address (127.0.0.1) as the first: the peer's share is full.
        assert "orca.max_streams_per_peer: 3" in await refusal(second)
        assert gw.parts.orca.streams == 3
        assert (refused(gw, "connection"), refused(gw, "peer"), refused(gw, "gateway")) == (
            1.0,
            1.0,
            0.0,
        )
        for call in held:
            call.cancel()
        await until(lambda: gw.parts.orca.streams == 0 and gw.parts.orca.shares.held() == 0)
        # Every share is free again.
        held = [await open_stream(first), await open_stream(second)]
        for call in held:
            call.cancel()
        await until(lambda: gw.parts.orca.streams == 0 and gw.parts.orca.shares.held() == 0)


async def test_with_api_keys_each_principal_has_its_own_share(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    settings: dict[str, Any] = {
        "auth.api_keys_file": str(keys),
        "orca.max_streams_per_connection": 4,
        "orca.max_streams_per_peer": 2,
    }
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), **settings) as gw,
        connection(gw) as channel,
    ):
        held = [await open_stream(channel, ALICE), await open_stream(channel, ALICE)]
        assert "for this caller" in await refusal(channel, ALICE)
        held.append(await open_stream(channel, BOB))  # same address, another principal
        assert gw.parts.orca.shares.held(owner="key:alice") == 2
        assert gw.parts.orca.shares.held(owner="key:bob") == 1
        for call in held:
            call.cancel()
        await until(lambda: gw.parts.orca.streams == 0 and gw.parts.orca.shares.held() == 0)
