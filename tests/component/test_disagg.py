"""Disaggregated serving through the gateway, with simulated PD/EPD workers that fail the
way the engines do when a rendezvous parameter is wrong. In process (tests/component/harness):
the subject is the placement and the relay of the legs, not the process boundary. (A
choice failing while another streams stays end to end, tests/e2e/test_disagg.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

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
from gateway_sim.model import input_logprobs_for, output_tokens
from tests.support.helpers import assert_verdict
from tests.support.inproc import Sim, gateway, pd_urls, sim
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)

PROMPT = [1, 2, 3]


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


def vllm_request(request_id: str, tokens: int = 4, stream: bool = True) -> Any:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm.SamplingParams(max_tokens=tokens),
        stream=stream,
    )


def bare(worker: Sim) -> str:
    """A URL without model, runtime or role: the gateway asks the worker."""
    return f"grpc://{worker.address}"


def address(gw: Any) -> str:
    return f"127.0.0.1:{gw.port}"


def tokens_of(messages: list[Any]) -> list[int]:
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]


def requests(logs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [e for e in logs if e.get("event") == "request" and e.get("rpc") == "Generate"]


async def logged(logs: Sequence[Mapping[str, Any]], count: int) -> list[Mapping[str, Any]]:
    """The Generate request events once `count` are logged (the line follows the reply)."""
    await until(lambda: len(requests(logs)) >= count)
    return requests(logs)


async def test_sglang_pd_streams_what_a_regular_worker_would() -> None:
    async with (
        sim("--role", "prefill", "--model", "m", "--ttft-ms", "20") as prefill,
        sim("--role", "decode", "--model", "m") as decode,
        # Bare URLs: runtime, model, role and bootstrap port all come from the workers.
        gateway(bare(prefill), bare(decode)) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with capture_logs() as logs:
            streamed, error = await collect(
                stub.Generate(sgl_request("pd-1", 6), metadata=model_md("m"))
            )
            assert error is None
            assert tokens_of(streamed) == output_tokens(PROMPT, 6)
            assert len(streamed) == 7
            assert streamed[-1].complete.finish_reason == "length"
            whole, error = await collect(
                stub.Generate(sgl_request("pd-2", 6, stream=False), metadata=model_md("m"))
            )
            assert error is None and len(whole) == 1
            assert list(whole[0].complete.output_ids) == output_tokens(PROMPT, 6)
            events = await logged(logs, 2)
        legs = {"prefill": [prefill.address], "decode": [decode.address]}
        assert all(e["legs"] == legs and e["worker"] == decode.address for e in events)
        assert all((e["attempts"], e["retries"]) == (1, 0) for e in events)
        assert all(e["code"] == "OK" and len(e["rooms"]) == 1 for e in events)
        assert 0 <= events[0]["rooms"][0] < 2**31
        assert await wait_idle(prefill.address) == 0 and await wait_idle(decode.address) == 0


async def test_prompt_logprobs_come_from_the_prefill_into_the_first_decode_chunk() -> None:
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        sim("--role", "decode", "--model", "m") as decode,
        gateway(*pd_urls(prefill, decode)) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        request = sgl_request("lp-1", 3, return_logprob=True)
        messages, error = await collect(stub.Generate(request, metadata=model_md("m")))
    assert error is None
    first = messages[0].chunk.input_logprobs
    values = [e.value if e.HasField("value") else None for e in first.token_logprobs]
    assert values == input_logprobs_for(PROMPT)
    assert list(first.token_ids) == PROMPT
    assert not messages[1].chunk.HasField("input_logprobs")


async def test_n3_gets_three_rooms_and_one_merged_stream() -> None:
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        sim("--role", "decode", "--model", "m") as decode,
        gateway(*pd_urls(prefill, decode)) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with capture_logs() as logs:
            messages, error = await collect(
                stub.Generate(sgl_request("n3", 4, n=3), metadata=model_md("m"))
            )
            (event,) = await logged(logs, 1)
    assert error is None
    assert len(messages) == 3 * 5
    assert {m.request_id for m in messages} == {"n3"}
    for index in range(3):
        mine = [
            m for m in messages if (m.chunk if m.HasField("chunk") else m.complete).index == index
        ]
        assert tokens_of(mine) == output_tokens(PROMPT, 4)
        assert mine[-1].complete.finish_reason == "length"
    assert len(event["rooms"]) == 3 and len(set(event["rooms"])) == 3


async def test_cancel_mid_stream_leaves_nothing_in_flight_on_either_leg() -> None:
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        sim("--role", "decode", "--model", "m", "--token-ms", "50") as decode,
        gateway(*pd_urls(prefill, decode)) as gw,
        channel(address(gw)) as ch,
    ):
        with capture_logs() as logs:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_request("cancel-1", 100), metadata=model_md("m")
            )
            assert (await call.read()).HasField("chunk")
            call.cancel()
            assert await wait_idle(decode.address) == 0
            assert await wait_idle(prefill.address) == 0
            (event,) = await logged(logs, 1)
    assert event["code"] == "CANCELLED"


async def test_a_cancel_before_the_first_token_lets_the_hand_off_finish() -> None:
    """A client that leaves while the prefill still computes: both legs end, nothing is
    left in flight and neither worker is blamed. (That the prefill is not cut under its
    decode, which leaves a real SGLang decode waiting on a bootstrap that never comes and
    then NOT_SERVING, is tests/engines/test_sglang_pd.py's: this simulator's decode
    gives up on its own.)"""
    async with (
        sim("--role", "prefill", "--model", "m", "--ttft-ms", "300") as prefill,
        sim("--role", "decode", "--model", "m", "--bootstrap-timeout-ms", "2000") as decode,
        gateway(*pd_urls(prefill, decode)) as gw,
        channel(address(gw)) as ch,
    ):
        with capture_logs() as logs:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(
                sgl_request("cancel-early", 100), metadata=model_md("m")
            )
            await until(lambda: gw.parts.fleet.registry.get(decode.address).inflight == 1)  # type: ignore[union-attr]
            call.cancel()
            (event,) = await logged(logs, 1)
            assert event["code"] == "CANCELLED"
            assert await wait_idle(decode.address) == 0
            assert await wait_idle(prefill.address) == 0
            await until(lambda: all(w.inflight == 0 for w in gw.parts.fleet.registry))
        for worker in gw.parts.fleet.registry:
            assert worker.outlier.failures == 0, worker.id


async def test_abort_reaches_both_legs_and_every_choice() -> None:
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        # (--abort-completes: the aborted stream ends, as a real SGLang decode's does not)
        sim("--role", "decode", "--model", "m", "--token-ms", "50", "--abort-completes") as decode,
        gateway(*pd_urls(prefill, decode)) as gw,
        channel(address(gw)) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_request("ab-1", 100, n=2), metadata=model_md("m"))
        assert (await call.read()).HasField("chunk")
        reply = await stub.Abort(sgl.AbortRequest(request_id="ab-1"), metadata=model_md("m"))
        assert reply.success
        rest = []
        async with asyncio.timeout(10):
            while (message := await call.read()) is not aio.EOF:
                rest.append(message)
        assert await call.code() is grpc.StatusCode.OK
        finals = [m.complete for m in rest if m.HasField("complete")]
        assert sorted(c.index for c in finals) == [0, 1]
        assert {c.finish_reason for c in finals} == {"abort"}
        assert await wait_idle(decode.address) == 0


async def test_vllm_pd_hands_the_kv_params_from_prefill_to_decode() -> None:
    async with (
        sim("--runtime", "vllm", "--role", "prefill", "--model", "m") as prefill,
        sim("--runtime", "vllm", "--role", "decode", "--model", "m") as decode,
        gateway(bare(prefill), bare(decode)) as gw,
        channel(address(gw)) as ch,
    ):
        await wait_health(address(gw), "m", "vllm")
        stub = vllm_grpc.VllmEngineStub(ch)
        streamed, error = await collect(
            stub.Generate(vllm_request("v-1", 5), metadata=model_md("m"))
        )
        assert error is None
        assert tokens_of(streamed) == output_tokens(PROMPT, 5)
        whole, error = await collect(
            stub.Generate(vllm_request("v-2", 5, stream=False), metadata=model_md("m"))
        )
        assert error is None
        assert list(whole[-1].complete.output_ids) == output_tokens(PROMPT, 5)


async def test_vllm_prefill_without_transfer_params_fails_naming_the_prefill() -> None:
    async with (
        sim("--runtime", "vllm", "--role", "prefill", "--model", "m", "--omit-kv-params") as p,
        sim("--runtime", "vllm", "--role", "decode", "--model", "m") as decode,
        gateway(*pd_urls(p, decode, runtime="vllm")) as gw,
        channel(address(gw)) as ch,
    ):
        with capture_logs() as logs:
            messages, error = await collect(
                vllm_grpc.VllmEngineStub(ch).Generate(vllm_request("v-3"), metadata=model_md("m"))
            )
            await logged(logs, 1)
        assert messages == [] and error is not None
        assert error.code() is grpc.StatusCode.INTERNAL
        assert error.details() == (
            f"prefill worker {p.address}: returned no kv_transfer_params; "
            "the decode cannot fetch the KV cache"
        )
        failures = gw.parts.metrics.prometheus.get_sample_value(
            "gateway_pd_handoff_failures_total", {"model": "m", "reason": "missing_kv_params"}
        )
        assert failures == 1.0


async def test_epd_two_encoders_share_the_items_and_feed_the_prefill() -> None:
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        sim("--role", "decode", "--model", "m") as decode,
        sim("--role", "encode", "--model", "m", "--name", "enc-a") as enc_a,
        sim("--role", "encode", "--model", "m", "--name", "enc-b") as enc_b,
        gateway(
            *pd_urls(prefill, decode, embedding_port=prefill.side["embedding"]),
            enc_a.url(model="m", role="encode"),
            enc_b.url(model="m", role="encode"),
        ) as gw,
        channel(address(gw)) as ch,
    ):
        # Rendezvous hashing per item: all of 24 on one encoder has odds of 2 in 2^24
        # (with 8 it was 1 in 128, a test that failed now and then).
        images = [f"http://images/{i}.png" for i in range(24)]
        request = sgl_request("epd-1", 3, mm_inputs=sgl.MultimodalInputs(image_urls=images))
        with capture_logs() as logs:
            messages, error = await collect(
                sgl_grpc.SglangSchedulerStub(ch).Generate(request, metadata=model_md("m"))
            )
            (event,) = await logged(logs, 1)
    assert error is None, error
    assert tokens_of(messages) == output_tokens(PROMPT, 3)
    assert set(event["legs"]) == {"encode", "prefill", "decode"}
    # Both encoders took part (the items hash onto both), the prefill waited for both parts.
    assert sorted(event["legs"]["encode"]) == sorted([enc_a.address, enc_b.address])


async def test_encoder_failure_fails_the_request_naming_the_encode_leg() -> None:
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        sim("--role", "decode", "--model", "m") as decode,
        sim("--role", "encode", "--model", "m") as encoder,
        # No embedding port for the prefill: the encoder cannot deliver and says so.
        gateway(*pd_urls(prefill, decode), encoder.url(model="m", role="encode")) as gw,
        channel(address(gw)) as ch,
    ):
        request = sgl_request(
            "epd-2", mm_inputs=sgl.MultimodalInputs(image_urls=["http://i/1.png"])
        )
        _, error = await collect(
            sgl_grpc.SglangSchedulerStub(ch).Generate(request, metadata=model_md("m"))
        )
    assert error is not None
    assert error.details().startswith(f"encode worker {encoder.address}: ")


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
