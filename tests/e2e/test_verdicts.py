"""Placement verdicts: exact code, message, ErrorInfo, RetryInfo, trailers.

Every verdict must travel as a Trailers-Only response: the client sees no response
headers, only the status and its trailers.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc import aio

from tests.conftest import Launcher, grpcurl, worker_url
from tests.e2e.helpers import (
    SGL_SERVICE,
    VLLM_SERVICE,
    assert_verdict,
    channel,
    closed_port,
    collect,
    dead_worker_url,
    model_md,
    rich_status,
    sgl,
    sgl_generate,
    sgl_grpc,
    start_many,
    trailers,
    vllm_generate,
    vllm_grpc,
    wait_for_events,
    wait_health,
    write_config,
)

UNAVAILABLE_MESSAGE = (
    "All {n} regular workers for model '{model}' are unavailable "
    "(not connected, unhealthy or circuit breaker open)"
)


async def test_unknown_model_is_a_trailers_only_not_found(sim: Launcher, gateway: Launcher) -> None:
    worker = sim("--runtime", "vllm", "--model", "m")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="vllm"))
    async with channel(gw.address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(vllm_generate(), metadata=model_md("nope"))
        assert len(await call.initial_metadata()) == 0  # Trailers-Only: no response headers
        messages, error = await collect(call)
    assert messages == []
    assert error is not None
    assert_verdict(
        error,
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        "Model 'nope' is not served by any worker",
        {"model": "nope", "leg": "", "httpStatus": "404", "code": "model_not_found"},
    )
    [event] = wait_for_events(gw.log_path, 1, rpc="Generate")  # type: ignore[attr-defined]
    assert event["code"] == "NOT_FOUND"
    assert event["model"] == "nope"
    assert event["attempts"] == 0
    assert event["messages"] == 0


async def test_model_served_over_the_other_protocol_says_where(
    sim: Launcher, gateway: Launcher
) -> None:
    worker = sim("--runtime", "sglang", "--model", "m")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    async with channel(gw.address) as ch:
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


async def test_model_resolution_from_metadata(sim: Launcher, gateway: Launcher) -> None:
    alpha, beta, gamma = start_many(
        sim,
        ("--runtime", "sglang", "--model", "alpha", "--name", "alpha-0"),
        ("--runtime", "sglang", "--model", "beta", "--name", "beta-0"),
        ("--runtime", "vllm", "--model", "gamma", "--name", "gamma-0"),
    )
    gw = gateway(
        "--worker",
        worker_url(alpha, model="alpha", runtime="sglang"),
        "--worker",
        worker_url(beta, model="beta", runtime="sglang"),
        "--worker",
        worker_url(gamma, model="gamma", runtime="vllm"),
    )
    await wait_health(gw.address, "alpha")
    await wait_health(gw.address, "beta")
    await wait_health(gw.address, "gamma", "vllm")
    async with channel(gw.address) as ch:
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


async def test_fleet_rpcs_with_no_available_worker_get_the_unavailable_verdict(
    gateway: Launcher,
) -> None:
    nobody = closed_port()
    gw = gateway("--worker", dead_worker_url(nobody, model="m", runtime="sglang"))
    async with channel(gw.address) as ch:
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


async def test_manual_policy_routes_to_the_named_worker_or_declines(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    a, b = start_many(
        sim,
        ("--runtime", "sglang", "--model", "m", "--name", "a"),
        ("--runtime", "sglang", "--model", "m", "--name", "b"),
    )
    config = write_config(tmp_path, {"models": {"m": {"policy": "manual"}}})
    gw = gateway(
        "--config",
        config,
        "--worker",
        worker_url(a, model="m", runtime="sglang"),
        "--worker",
        worker_url(b, model="m", runtime="sglang"),
    )
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
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
