"""Disaggregated serving's legs through the gateway, in process (simulated PD/EPD workers):
the verdict that names the leg missing or down (no encode workers, every decode down, no
compatible pair, prefill only), a decode limited to one call never running two, and the
bound on a decode's first message (a stalled decode given up for another, or the call
ended naming the bound)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway.app.server import Gateway
from gateway_sim.client import (
    channel,
    collect,
    model_md,
    sgl,
    sgl_grpc,
    vllm,
    vllm_grpc,
    wait_health,
    wait_idle,
)
from gateway_sim.model import output_tokens
from tests.support.disagg import PROMPT, address, logged, sgl_request, tokens_of, vllm_request
from tests.support.helpers import assert_verdict
from tests.support.inproc import gateway, pd_urls, sim
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)


class TestLegVerdicts:
    """Each demanded leg judged by its own pool, through the real front."""

    async def test_no_encode_workers_for_a_multimodal_request_is_leg_not_deployed(
        self,
    ) -> None:
        async with (
            sim("--role", "prefill", "--model", "m") as prefill,
            sim("--role", "decode", "--model", "m") as decode,
            gateway(*pd_urls(prefill, decode), models={"m": {"encode_leg": True}}) as gw,
            channel(address(gw)) as ch,
        ):
            image = sgl_request(
                "v-1", mm_inputs=sgl.MultimodalInputs(image_urls=["http://i/1.png"])
            )
            stub = sgl_grpc.SglangSchedulerStub(ch)
            _, error = await collect(stub.Generate(image, metadata=model_md("m")))
            assert error is not None
            assert_verdict(
                error,
                grpc.StatusCode.NOT_FOUND,
                "LEG_NOT_DEPLOYED",
                "Model 'm' has no encode workers registered",
                {"model": "m", "leg": "encode", "httpStatus": "404", "code": "leg_not_deployed"},
            )
            # The same model still serves text requests.
            text, error = await collect(stub.Generate(sgl_request("v-2"), metadata=model_md("m")))
            assert error is None and len(text) == 5

    async def test_healthy_prefill_and_every_decode_down_names_decode_only(self) -> None:
        async with (
            sim("--role", "prefill", "--model", "m") as prefill,
            contextlib.AsyncExitStack() as decodes,
        ):
            decode = await decodes.enter_async_context(sim("--role", "decode", "--model", "m"))
            async with gateway(*pd_urls(prefill, decode)) as gw, channel(address(gw)) as ch:
                await wait_health(address(gw), "m")
                await decodes.aclose()  # the decode goes away
                await wait_health(address(gw), "m", healthy=False)
                call = sgl_grpc.SglangSchedulerStub(ch).Generate(
                    sgl_request("v-3"), metadata=model_md("m")
                )
                assert await call.initial_metadata() == aio.Metadata()  # Trailers-Only
                _, error = await collect(call)
        assert error is not None
        assert_verdict(
            error,
            grpc.StatusCode.UNAVAILABLE,
            "WORKERS_UNAVAILABLE",
            "All 1 decode workers for model 'm' are unavailable "
            "(not connected, unhealthy or ejected by outlier detection)",
            {"model": "m", "leg": "decode", "httpStatus": "503", "code": "no_available_workers"},
            retry_s=1,
            pushback_ms=1000,
        )

    async def test_sglang_prefill_and_vllm_decode_is_no_compatible_pair(self) -> None:
        message = (
            "The prefill and decode workers for model 'm' share no runtime or KV transfer "
            "setup (prefill on sglang [sim]; decode on vllm [NixlConnector kv_cache_dtype=auto "
            "block_size=128])"
        )
        async with (
            sim("--role", "prefill", "--model", "m") as prefill,
            sim("--runtime", "vllm", "--role", "decode", "--model", "m") as decode,
            # Both are probed ready before the block starts: the pair can never form.
            gateway(
                prefill.url(model="m", runtime="sglang", role="prefill"),
                decode.url(model="m", runtime="vllm", role="decode"),
            ) as gw,
            channel(address(gw)) as ch,
        ):
            _, error = await collect(
                sgl_grpc.SglangSchedulerStub(ch).Generate(
                    sgl_request("v-4"), metadata=model_md("m")
                )
            )
        assert error is not None
        assert_verdict(
            error,
            grpc.StatusCode.NOT_FOUND,
            "NO_COMPATIBLE_PAIR",
            message,
            {
                "model": "m",
                "leg": "prefill,decode",
                "httpStatus": "404",
                "code": "no_compatible_pair",
            },
        )

    async def test_prefill_only_is_leg_not_deployed_for_decode(self) -> None:
        async with (
            sim("--role", "prefill", "--model", "m") as prefill,
            gateway(prefill.url(model="m", runtime="sglang", role="prefill")) as gw,
            channel(address(gw)) as ch,
        ):
            _, error = await collect(
                sgl_grpc.SglangSchedulerStub(ch).Generate(
                    sgl_request("v-5"), metadata=model_md("m")
                )
            )
        assert error is not None
        assert_verdict(
            error,
            grpc.StatusCode.NOT_FOUND,
            "LEG_NOT_DEPLOYED",
            "Model 'm' has no decode workers registered",
            {"model": "m", "leg": "decode", "httpStatus": "404", "code": "leg_not_deployed"},
        )


async def test_vllm_pd_decode_limited_to_one_never_runs_two() -> None:
    """Two prefills, one decode, `max_inflight: 1`, 8 clients: the decode is reserved when
    its request is placed, so while one request is on it (prefilling or decoding) the
    others are shed, and the decode's own GetLoads never shows two running."""
    vllm_pd = ("--runtime", "vllm", "--model", "m")
    async with (
        sim(*vllm_pd, "--role", "prefill", "--ttft-ms", "60") as p1,
        sim(*vllm_pd, "--role", "prefill", "--ttft-ms", "60") as p2,
        sim(*vllm_pd, "--role", "decode", "--token-ms", "15") as decode,
        gateway(
            *pd_urls(p1, decode, runtime="vllm"),
            p2.url(model="m", runtime="vllm", role="prefill"),
            models={"m": {"max_inflight": 1}},
        ) as gw,
    ):
        peak = 0
        done = asyncio.Event()

        async def watch_decode() -> None:
            nonlocal peak
            async with aio.insecure_channel(decode.address) as ch:
                stub = vllm_grpc.VllmEngineStub(ch)
                while not done.is_set():
                    loads = await stub.GetLoads(vllm.GetLoadsRequest(), timeout=2)
                    peak = max(peak, sum(load.num_running_reqs for load in loads.loads))
                    await asyncio.sleep(0.003)

        codes: list[grpc.StatusCode] = []

        async def one_client(index: int) -> None:
            async with channel(address(gw)) as ch:
                stub = vllm_grpc.VllmEngineStub(ch)
                for j in range(6):
                    _, error = await collect(
                        stub.Generate(vllm_request(f"c{index}-{j}", 8), metadata=model_md("m"))
                    )
                    codes.append(grpc.StatusCode.OK if error is None else error.code())

        watcher = asyncio.ensure_future(watch_decode())
        try:
            await asyncio.gather(*(one_client(i) for i in range(8)))
        finally:
            done.set()
            await watcher
        assert peak == 1
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert await wait_idle(decode.address, "vllm") == 0


def stalled_handoffs(gw: Gateway) -> float | None:
    return gw.parts.metrics.prometheus.get_sample_value(
        "gateway_pd_handoff_failures_total", {"model": "m", "reason": "decode_stalled"}
    )


class TestDecodeFirstMessageBound:
    """`disagg.decode_first_message_timeout_s`: a decode that sends nothing within it (a KV
    transfer stalled, as vLLM's NIXL path on a starved CPU does: docs/real-engines.md) is
    given up before any byte reached the client and the call placed again without it; the
    abandoned decode is cancelled once it starts, as after a client cancel, and nobody is
    blamed."""

    VLLM_PD = ("--runtime", "vllm", "--model", "m")

    async def test_a_stalled_decode_is_given_up_and_the_call_served_by_another(self) -> None:
        async with (
            sim(*self.VLLM_PD, "--role", "prefill") as prefill,
            sim(*self.VLLM_PD, "--role", "decode", "--ttft-ms", "2000") as stalled,
            sim(*self.VLLM_PD, "--role", "decode") as healthy,
            gateway(
                *pd_urls(prefill, stalled, runtime="vllm"),
                healthy.url(model="m", runtime="vllm", role="decode"),
                disagg={"decode_first_message_timeout_s": 0.3},
            ) as gw,
            channel(address(gw)) as ch,
        ):
            stub = vllm_grpc.VllmEngineStub(ch)
            with capture_logs() as logs:
                for i in range(2):  # round robin: one of them lands on the stalled decode
                    messages, error = await collect(
                        stub.Generate(vllm_request(f"stall-{i}", 5), metadata=model_md("m"))
                    )
                    assert error is None
                    assert tokens_of(messages) == output_tokens(PROMPT, 5)
                lines = await logged(logs, 2)
            retried = [line for line in lines if line["attempts"] == 2]
            assert retried  # round robin put at least one on the stalled decode
            for line in retried:
                assert line["legs"]["decode"] == [stalled.address, healthy.address]
                assert line["code"] == "OK"
            assert stalled_handoffs(gw) == len(retried)
            # the abandoned decode ran until its first message, then was cancelled
            assert await wait_idle(stalled.address, "vllm") == 0
            assert await wait_idle(healthy.address, "vllm") == 0
            await until(lambda: all(w.inflight == 0 for w in gw.parts.fleet.registry))
            assert all(w.outlier.failures == 0 for w in gw.parts.fleet.registry)

    async def test_the_only_decode_stalling_ends_the_call_unavailable_naming_the_bound(
        self,
    ) -> None:
        async with (
            sim(*self.VLLM_PD, "--role", "prefill") as prefill,
            sim(*self.VLLM_PD, "--role", "decode", "--ttft-ms", "1500") as decode,
            gateway(
                *pd_urls(prefill, decode, runtime="vllm"),
                disagg={"decode_first_message_timeout_s": 0.2},
                max_attempts=3,
            ) as gw,
            channel(address(gw)) as ch,
        ):
            with capture_logs() as logs:
                messages, error = await collect(
                    vllm_grpc.VllmEngineStub(ch).Generate(
                        vllm_request("stall-always"), metadata=model_md("m")
                    )
                )
                (line,) = await logged(logs, 1)
            assert messages == [] and error is not None
            assert error.code() is grpc.StatusCode.UNAVAILABLE
            assert error.details() == (
                f"decode worker {decode.address}: no first message within 0.2 s "
                "(disagg.decode_first_message_timeout_s)"
            )
            assert line["attempts"] == 1 and line["legs"]["decode"] == [decode.address]
            assert stalled_handoffs(gw) == 1.0  # one call (the metric counts calls)
            assert await wait_idle(decode.address, "vllm") == 0
            assert await wait_idle(prefill.address, "vllm") == 0
            await until(  # the gateway holds nothing of it either
                lambda: (
                    len(gw.parts.inflight) == 0
                    and all(w.inflight == 0 for w in gw.parts.fleet.registry)
                )
            )
            assert all(w.outlier.failures == 0 for w in gw.parts.fleet.registry)
