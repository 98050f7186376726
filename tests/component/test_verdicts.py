"""Placement verdicts: exact code, message, ErrorInfo, RetryInfo, trailers. In process
(tests/component/harness): the subject is the front's answer, which crosses a real gRPC
connection either way. (Through the gateway process, with grpcurl and a worker killed:
tests/e2e/test_verdicts.py.)

Every verdict must travel as a Trailers-Only response: the client sees no response
headers, only the status and its trailers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway_sim.client import (
    SGL_SERVICE,
    VLLM_SERVICE,
    channel,
    closed_port,
    collect,
    dead_worker_url,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    trailers,
    vllm_generate,
    vllm_grpc,
)
from tests.support.helpers import assert_verdict, rich_status
from tests.support.inproc import gateway, sim
from tests.support.waits import until


def address(gw: Any) -> str:
    return f"127.0.0.1:{gw.port}"


async def test_unknown_model_is_a_trailers_only_not_found() -> None:
    async with (
        sim("--runtime", "vllm", "--model", "m") as worker,
        gateway(worker.url(model="m", runtime="vllm")) as gw,
        channel(address(gw)) as ch,
    ):
        with capture_logs() as logs:
            call = vllm_grpc.VllmEngineStub(ch).Generate(vllm_generate(), metadata=model_md("nope"))
            assert len(await call.initial_metadata()) == 0  # Trailers-Only: no response headers
            messages, error = await collect(call)

            def generate_events() -> list[Mapping[str, Any]]:
                return [e for e in logs if e.get("event") == "request" and e["rpc"] == "Generate"]

            await until(lambda: len(generate_events()) >= 1)  # the line follows the reply
    assert messages == []
    assert error is not None
    assert_verdict(
        error,
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        "Model 'nope' is not served by any worker",
        {"model": "nope", "leg": "", "httpStatus": "404", "code": "model_not_found"},
    )
    [event] = generate_events()
    assert event["code"] == "NOT_FOUND"
    assert event["model"] == "nope"
    assert event["attempts"] == 0
    assert event["messages"] == 0


async def test_model_served_over_the_other_protocol_says_where() -> None:
    async with (
        sim("--runtime", "sglang", "--model", "m") as worker,
        gateway(worker.url(model="m", runtime="sglang")) as gw,
        channel(address(gw)) as ch,
    ):
        stub = vllm_grpc.VllmEngineStub(ch)
        _, named = await collect(stub.Generate(vllm_generate(), metadata=model_md("m")))
        _, unnamed = await collect(stub.Generate(vllm_generate()))
    assert named is not None
    assert_verdict(
        named,
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        f"Model 'm' is not served over {VLLM_SERVICE}; it is served over {SGL_SERVICE}",
        {"model": "m", "leg": "", "httpStatus": "404", "code": "model_not_found"},
    )
    # No metadata and no model at all on this protocol: still a precise NOT_FOUND.
    assert unnamed is not None
    assert_verdict(
        unnamed,
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        f"No model is served over {VLLM_SERVICE}",
        {"model": "", "leg": "", "httpStatus": "404", "code": "model_not_found"},
    )


async def test_model_resolution_from_metadata() -> None:
    async with (
        sim("--runtime", "sglang", "--model", "alpha", "--name", "alpha-0") as alpha,
        sim("--runtime", "sglang", "--model", "beta", "--name", "beta-0") as beta,
        sim("--runtime", "vllm", "--model", "gamma", "--name", "gamma-0") as gamma,
        gateway(
            alpha.url(model="alpha", runtime="sglang"),
            beta.url(model="beta", runtime="sglang"),
            gamma.url(model="gamma", runtime="vllm"),
        ) as gw,
        channel(address(gw)) as ch,
    ):
        sgl_stub = sgl_grpc.SglangSchedulerStub(ch)

        # Two models over SglangScheduler and no metadata: the client must name one.
        call = sgl_stub.Generate(sgl_generate())
        assert len(await call.initial_metadata()) == 0
        _, error = await collect(call)
        assert error is not None
        assert_verdict(
            error,
            grpc.StatusCode.INVALID_ARGUMENT,
            "MODEL_REQUIRED",
            "Several models are served here (alpha, beta); "
            "name one with the 'x-model-id' request metadata",
            {"model": "", "leg": "", "httpStatus": "400", "code": "model_required"},
        )

        async def served_by(metadata: tuple[tuple[str, str], ...]) -> str:
            call = sgl_stub.Generate(sgl_generate(tokens=2), metadata=metadata)
            messages, error = await collect(call)
            assert error is None
            assert len(messages) == 3
            return str(dict(await call.initial_metadata())["x-sim-worker"])

        assert await served_by((("x-model-id", "alpha"),)) == "alpha-0"
        assert await served_by((("x-gateway-model-name", "beta"),)) == "beta-0"
        # x-model-id is the configured header; it wins over the alias.
        both = (("x-gateway-model-name", "beta"), ("x-model-id", "alpha"))
        assert await served_by(both) == "alpha-0"

        # VllmEngine serves exactly one model: no metadata needed.
        vllm_call = vllm_grpc.VllmEngineStub(ch).Generate(vllm_generate(tokens=3))
        messages, error = await collect(vllm_call)
        assert error is None
        assert len(messages) == 4
        assert dict(await vllm_call.initial_metadata())["x-sim-worker"] == "gamma-0"


async def test_fleet_rpcs_with_no_available_worker_get_the_unavailable_verdict() -> None:
    nobody = closed_port()
    async with (
        gateway(dead_worker_url(nobody, model="m", runtime="sglang"), ready=False) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        calls = {
            "GetModelInfo": stub.GetModelInfo(sgl.GetModelInfoRequest(), metadata=model_md("m")),
            "GetLoads": stub.GetLoads(sgl.GetLoadsRequest(), metadata=model_md("m")),
        }
        for name, call in calls.items():
            with pytest.raises(aio.AioRpcError) as caught:
                await call
            assert len(await call.initial_metadata()) == 0, name
            error = caught.value
            assert error.code() is grpc.StatusCode.UNAVAILABLE, name
            assert "model 'm'" in error.details()
            status, details = rich_status(error)
            assert status.message == error.details()
            info = details["ErrorInfo"]
            assert info.reason == "WORKERS_UNAVAILABLE"
            assert info.metadata["model"] == "m"
            assert info.metadata["httpStatus"] == "503"
            assert info.metadata["code"] == "no_available_workers"
            assert details["RetryInfo"].retry_delay.ToMilliseconds() == 1000
            plain = trailers(error)
            assert (plain["x-http-status"], plain["retry-after"]) == ("503", "1")
            assert plain["grpc-retry-pushback-ms"] == "1000"
        # The engine HealthCheck is answered, not refused.
        reply = await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=model_md("m"))
        assert reply.healthy is False
    nobody.close()


async def test_manual_policy_routes_to_the_named_worker_or_declines() -> None:
    async with (
        sim("--runtime", "sglang", "--model", "m", "--name", "a") as a,
        sim("--runtime", "sglang", "--model", "m", "--name", "b") as b,
        gateway(
            a.url(model="m", runtime="sglang"),
            b.url(model="m", runtime="sglang"),
            models={"m": {"policy": "manual"}},
        ) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for _ in range(3):
            call = stub.Generate(
                sgl_generate(tokens=1), metadata=model_md("m", ("x-target-worker", b.address))
            )
            messages, error = await collect(call)
            assert error is None
            assert len(messages) == 2
            assert dict(await call.initial_metadata())["x-sim-worker"] == "b"

        nobody = closed_port()
        unknown = f"127.0.0.1:{nobody.getsockname()[1]}"
        call = stub.Generate(sgl_generate(), metadata=model_md("m", ("x-target-worker", unknown)))
        assert len(await call.initial_metadata()) == 0
        messages, error = await collect(call)
        nobody.close()
    assert messages == []
    assert error is not None
    assert_verdict(
        error,
        grpc.StatusCode.UNAVAILABLE,
        "POLICY_DECLINED",
        "The manual policy picked none of the available regular workers for model 'm'",
        {
            "model": "m",
            "leg": "regular",
            "httpStatus": "503",
            "code": "policy_declined",
            "policy": "manual",
        },
        retry_s=1,
        pushback_ms=None,  # a policy decline is retryable, but carries no pushback
    )
