"""Disaggregated serving through the gateway, with simulated PD/EPD workers that fail the
way the engines do when a rendezvous parameter is wrong. In process (tests/component/harness):
the subject is the placement and the relay of the legs, not the process boundary: SGLang
PD streams, vLLM's KV parameters handed from prefill to decode, EPD encoders feeding the
prefill, cancels and aborts reaching every leg. (Leg verdicts and the decode's bounds:
tests/component/test_disagg_legs.py; a choice failing while another streams stays end to
end, tests/e2e/test_disagg.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway_sim.client import (
    channel,
    collect,
    model_md,
    sgl,
    sgl_grpc,
    vllm_grpc,
    wait_health,
    wait_idle,
)
from gateway_sim.model import input_logprobs_for, output_tokens
from tests.support.disagg import PROMPT, address, logged, sgl_request, tokens_of, vllm_request
from tests.support.inproc import Sim, gateway, pd_urls, sim
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)


def bare(worker: Sim) -> str:
    """A URL without model, runtime or role: the gateway asks the worker."""
    return f"grpc://{worker.address}"


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
