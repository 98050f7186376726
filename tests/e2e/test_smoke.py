"""The spine: one gateway, simulated workers of both engines, real processes."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from gateway_sim.client import channel, model_md, sgl_generate, sgl_grpc, trailers
from gateway_sim.launch import worker_url
from tests.support.helpers import rich_status
from tests.support.launch import Launcher


async def test_generate_streams_through_and_unknown_model_is_not_found(
    sim: Launcher, gateway: Launcher
) -> None:
    a = sim("--runtime", "sglang", "--model", "m")
    gw = gateway("--worker", worker_url(a))
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        replies = [r async for r in stub.Generate(sgl_generate(tokens=5), metadata=model_md("m"))]
        assert len(replies) == 6
        assert replies[-1].complete.finish_reason == "length"
        with pytest.raises(aio.AioRpcError) as caught:
            async for _ in stub.Generate(sgl_generate(), metadata=model_md("nope")):
                pass
    error = caught.value
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert error.details() == "Model 'nope' is not served by any worker"
    status, details = rich_status(error)
    assert status.code == grpc.StatusCode.NOT_FOUND.value[0]
    info = details["ErrorInfo"]
    assert info.reason == "MODEL_NOT_FOUND"
    assert dict(info.metadata) == {
        "model": "nope",
        "leg": "",
        "httpStatus": "404",
        "code": "model_not_found",
    }
    assert "RetryInfo" not in details
    assert trailers(error)["x-http-status"] == "404"
    assert "retry-after" not in trailers(error)
