"""Placement verdicts through the gateway process: after a worker is killed, and as
grpcurl shows them. The others are tested in process (tests/component/test_verdicts.py).

Every verdict must travel as a Trailers-Only response: the client sees no response
headers, only the status and its trailers.
"""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from gateway_sim.client import (
    SGL_SERVICE,
    channel,
    closed_port,
    collect,
    dead_worker_url,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    wait_health,
)
from gateway_sim.launch import worker_url
from tests.support.helpers import assert_verdict
from tests.support.launch import Launcher, grpcurl

UNAVAILABLE_MESSAGE = (
    "All {n} regular workers for model '{model}' are unavailable "
    "(not connected, unhealthy or ejected by outlier detection)"
)


@pytest.mark.sim_processes  # SIGKILL
async def test_workers_unavailable_after_the_worker_dies(sim: Launcher, gateway: Launcher) -> None:
    worker = sim("--runtime", "sglang", "--model", "m")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        messages, error = await collect(stub.Generate(sgl_generate(), metadata=model_md("m")))
        assert error is None
        assert len(messages) == 5

        worker.kill()
        await wait_health(gw.address, "m", healthy=False)

        call = stub.Generate(sgl_generate(), metadata=model_md("m"))
        assert len(await call.initial_metadata()) == 0
        messages, error = await collect(call)
        assert messages == []
        assert error is not None
        expected = {
            "model": "m",
            "leg": "regular",
            "httpStatus": "503",
            "code": "no_available_workers",
        }
        assert_verdict(
            error,
            grpc.StatusCode.UNAVAILABLE,
            "WORKERS_UNAVAILABLE",
            UNAVAILABLE_MESSAGE.format(n=1, model="m"),
            expected,
            retry_s=1,
            pushback_ms=1000,
        )

        # Embed (unary) is placed the same way and gets the same verdict.
        with pytest.raises(aio.AioRpcError) as caught:
            await stub.Embed(
                sgl.EmbedRequest(request_id="e1", tokenized=sgl.TokenizedInput(input_ids=[1])),
                metadata=model_md("m"),
            )
    assert_verdict(
        caught.value,
        grpc.StatusCode.UNAVAILABLE,
        "WORKERS_UNAVAILABLE",
        UNAVAILABLE_MESSAGE.format(n=1, model="m"),
        expected,
        retry_s=1,
        pushback_ms=1000,
    )


def test_verdict_trailers_are_visible_to_grpcurl(gateway: Launcher) -> None:
    # A worker that never answers stays `pending`: the model is known but unavailable.
    nobody = closed_port()
    gw = gateway("--worker", dead_worker_url(nobody, model="m", runtime="sglang"))
    result = grpcurl(
        "-plaintext",
        "-v",
        "-H",
        "x-model-id: m",
        "-d",
        '{"request_id":"g1","tokenized":{"input_ids":[1,2,3]}}',
        gw.address,
        f"{SGL_SERVICE}/Generate",
    )
    out = result.stdout + result.stderr
    assert result.returncode == 64 + grpc.StatusCode.UNAVAILABLE.value[0], out
    assert "Response headers received:\n(empty)" in out
    trailer_block = out.split("Response trailers received:", 1)[1].split("Sent 1 request", 1)[0]
    trailer_lines = set(trailer_block.strip().splitlines())
    assert {"x-http-status: 503", "retry-after: 1", "grpc-retry-pushback-ms: 1000"} <= (
        trailer_lines
    )
    assert "Code: Unavailable" in out
    assert f"Message: {UNAVAILABLE_MESSAGE.format(n=1, model='m')}" in out
    assert '"reason":"WORKERS_UNAVAILABLE"' in out
    assert '"retry_delay":"1s"' in out
