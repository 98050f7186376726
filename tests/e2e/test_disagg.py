"""Disaggregated serving through the gateway process. The placement and relay of the legs
are tested in process (tests/component/test_disagg.py); here, a choice that fails while
another streams, with the workers in their own processes: in one event loop, that race
ends the client's call with no status now and then (the front's abort meets a write still
in flight on the same stream: GRPC_CALL_ERROR_TOO_MANY_OPERATIONS)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from gateway_sim.client import channel, collect, model_md, sgl, sgl_grpc, wait_health, wait_idle
from gateway_sim.launch import Child, start_many, worker_url
from tests.support.launch import Launcher

PROMPT = [1, 2, 3]

# The workers in processes of their own (see above).
pytestmark = pytest.mark.sim_processes


def sgl_request(
    request_id: str, tokens: int = 4, stream: bool = True, n: int = 1, **extra: Any
) -> Any:
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=PROMPT),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens, n=n),
        stream=stream,
        **extra,
    )


def pd_urls(prefill: Child, decode: Child, runtime: str = "sglang", **extra: str) -> list[str]:
    """Worker flags for a prefill and a decode, roles and ports given explicitly."""
    prefill_query = {"model": "m", "runtime": runtime, "role": "prefill", **extra}
    if "bootstrap" in prefill.extra:
        prefill_query["bootstrap_port"] = prefill.extra["bootstrap"]
    return [
        "--worker",
        worker_url(prefill, **prefill_query),
        "--worker",
        worker_url(decode, model="m", runtime=runtime, role="decode"),
    ]


async def test_a_failing_choice_ends_the_stream_with_its_status_and_cancels_the_rest(
    sim: Launcher, gateway: Launcher
) -> None:
    prefill, decode = start_many(
        sim,
        ("--role", "prefill", "--model", "m"),
        # A decode whose prefill was cancelled before the hand-off waits for the KV this
        # long, then ends: well within wait_idle's bound (the default, 3 s, is not).
        ("--role", "decode", "--model", "m", "--token-ms", "20", "--bootstrap-timeout-ms", "1000"),
    )
    gw = gateway(*pd_urls(prefill, decode))
    await wait_health(gw.address, "m")
    failing = model_md("m", ("x-sim-fail-code", "INTERNAL"), ("x-sim-fail-after", "3"))
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        _, error = await asyncio.wait_for(
            collect(stub.Generate(sgl_request("nf", 50, n=2), metadata=failing)), 10
        )
    assert error is not None
    assert error.code() is grpc.StatusCode.INTERNAL
    assert error.details().startswith(
        (f"prefill worker {prefill.address}: ", f"decode worker {decode.address}: ")
    )
    assert await wait_idle(decode.address) == 0
    assert await wait_idle(prefill.address) == 0
