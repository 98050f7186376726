"""A decode's running window (vLLM's max_num_seqs, SGLang's max_running_requests, from its
GetServerInfo) bounds the gateway's calls to it. A burst six times wider than the window:
without flow control every call is served or refused RESOURCE_EXHAUSTED
(WORKERS_OVERLOADED, leg decode, retry info) at once; with flow control every call is
served, the rest waiting in the gateway rather than in the decode, where each would hold
its prefill's KV on a lease. Nothing is left in flight after."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from gateway_sim.client import (
    channel,
    collect,
    model_md,
    stub_for,
    vllm_generate,
    wait_health,
    write_config,
)
from gateway_sim.launch import worker_url
from tests.support.helpers import rich_status
from tests.support.launch import Launcher

WINDOW = 2
BURST = 6 * WINDOW


async def burst(address: str) -> list[grpc.aio.AioRpcError | None]:
    async with channel(address) as ch:
        stub = stub_for(ch, "vllm")
        calls = [
            collect(stub.Generate(vllm_generate(f"w{i}", 20), metadata=model_md("m"), timeout=30))
            for i in range(BURST)
        ]
        return [error for _, error in await asyncio.gather(*calls)]


def pd_gateway(sim: Launcher, gateway: Launcher, tmp_path: Path, flow: bool) -> str:
    prefill = sim("--runtime", "vllm", "--role", "prefill", "--model", "m")
    decode = sim(
        "--runtime", "vllm", "--role", "decode", "--model", "m",
        "--max-running", str(WINDOW), "--token-ms", "20",
    )  # fmt: skip
    settings: dict[str, object] = {
        "workers": [
            worker_url(prefill, model="m", runtime="vllm", role="prefill"),
            worker_url(decode, model="m", runtime="vllm", role="decode"),
        ]
    }
    if flow:
        settings["flow"] = {}
    gw = gateway("--config", write_config(tmp_path, settings))
    return gw.address


async def test_a_burst_past_the_decode_window_is_served_or_refused_at_once(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    address = pd_gateway(sim, gateway, tmp_path, flow=False)
    await wait_health(address, "m", "vllm")
    errors = await burst(address)
    refused = [e for e in errors if e is not None]
    served = BURST - len(refused)
    print(f"\n[decode window {WINDOW}] burst {BURST}: {served} served, {len(refused)} refused")
    assert served >= WINDOW and refused  # the first calls hold the window while the rest come
    for error in refused:
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        _, details = rich_status(error)
        assert details["ErrorInfo"].reason == "WORKERS_OVERLOADED"
        assert details["ErrorInfo"].metadata["leg"] == "decode"
        assert "RetryInfo" in details


async def test_with_flow_control_the_burst_waits_in_the_gateway_and_is_all_served(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    address = pd_gateway(sim, gateway, tmp_path, flow=True)
    await wait_health(address, "m", "vllm")
    errors = await burst(address)
    assert errors == [None] * BURST
