"""The relay: message counts, headers, metadata hygiene, concurrent streams, bad input and
large messages. (Deadlines, cancellation and mid-stream failures:
tests/e2e/test_relay_failures.py.)

After every test the simulated worker is asked directly (GetLoads) that nothing stays
running there.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from gateway_sim.client import (
    SGL_SERVICE,
    VLLM_SERVICE,
    channel,
    collect,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    trailers,
    vllm,
    vllm_generate,
    vllm_grpc,
    wait_idle,
)
from tests.support import relay
from tests.support.helpers import wait_for_events
from tests.support.relay import Fleet
from tests.support.waits import WAIT_S

fleet = relay.fleet  # the fixture (tests/support/relay.py)
ready = relay.ready  # the fixture (tests/support/relay.py)


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_both_protocols_relay_exact_message_counts(ready: Fleet) -> None:
    gw = ready.gateway
    async with channel(gw.address) as ch:
        sgl_stub = sgl_grpc.SglangSchedulerStub(ch)
        vllm_stub = vllm_grpc.VllmEngineStub(ch)

        call = sgl_stub.Generate(sgl_generate("s1", tokens=5), metadata=model_md("s"))
        messages, error = await collect(call)
        assert error is None
        assert len(messages) == 6  # 5 chunks + complete
        # The simulator's output: the prompt's first token + its length, counting up.
        assert [m.chunk.token_ids[0] for m in messages[:5]] == [4, 5, 6, 7, 8]
        assert all(m.request_id == "s1" for m in messages)
        assert messages[-1].complete.finish_reason == "length"
        # SGLang's streamed Complete repeats its last chunk's tokens, with the totals.
        assert list(messages[-1].complete.output_ids) == [8]
        assert messages[-1].complete.completion_tokens == 5
        assert dict(await call.initial_metadata())["x-sim-worker"] == "sgl-0"

        call = sgl_stub.Generate(sgl_generate("s2", tokens=5, stream=False), metadata=model_md("s"))
        messages, error = await collect(call)
        assert error is None
        assert len(messages) == 1
        assert list(messages[0].complete.output_ids) == [4, 5, 6, 7, 8]

        call = sgl_stub.Generate(sgl_generate("s3", tokens=3, n=2), metadata=model_md("s"))
        messages, error = await collect(call)
        assert error is None
        assert len(messages) == 2 * 3 + 2
        completes = [m.complete.index for m in messages if m.HasField("complete")]
        assert completes == [0, 1]

        call = vllm_stub.Generate(vllm_generate("v1", tokens=7), metadata=model_md("v"))
        messages, error = await collect(call)
        assert error is None
        assert len(messages) == 8
        assert messages[-1].complete.finish_reason == "length"
        # vLLM streams deltas: each chunk counts its own token, the Complete its last.
        assert sum(m.chunk.completion_tokens for m in messages[:-1]) == 7
        assert messages[-1].complete.completion_tokens == 1
        assert dict(await call.initial_metadata())["x-sim-worker"] == "vllm-0"

        call = vllm_stub.Generate(
            vllm_generate("v2", tokens=7, stream=False), metadata=model_md("v")
        )
        messages, error = await collect(call)
        assert error is None
        assert len(messages) == 1
        assert messages[0].complete.completion_tokens == 7

        # Embed is placed and relayed as a unary call, headers included.
        embed = sgl_stub.Embed(
            sgl.EmbedRequest(request_id="e1", tokenized=sgl.TokenizedInput(input_ids=[1, 2])),
            metadata=model_md("s"),
        )
        reply = await embed
        assert reply.embedding_dim == 8
        assert reply.prompt_tokens == 2
        assert dict(await embed.initial_metadata())["x-sim-worker"] == "sgl-0"
        vllm_reply = await vllm_stub.Embed(
            vllm.EmbedRequest(request_id="e2", tokenized=vllm.TokenizedInput(input_ids=[1, 2])),
            metadata=model_md("v"),
        )
        assert list(vllm_reply.embedding) == list(reply.embedding)

    ids = ["s1", "s2", "s3", "v1", "v2"]
    events = [wait_for_events(ready.log_path, 1, "Generate", i)[-1] for i in ids]
    assert [e["messages"] for e in events] == [6, 1, 8, 8, 1]
    assert all(e["code"] == "OK" and e["attempts"] == 1 for e in events)
    assert [e["model"] for e in events] == ["s", "s", "s", "v", "v"]


async def test_response_headers_are_relayed_before_the_first_message(ready: Fleet) -> None:
    """The worker's headers reach the client while its first message is two minutes
    away (waited for WAIT_S at most: no clock to read); the call, cancelled then, ends on
    the worker too. With a first message that comes, the stream follows the headers."""
    gw = ready.gateway
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(
            sgl_generate(tokens=2),
            metadata=model_md("s", ("x-sim-ttft-ms", "120000"), ("x-sim-headers-first", "1")),
        )
        headers = await asyncio.wait_for(call.initial_metadata(), WAIT_S)
        call.cancel()
        assert await wait_idle(ready.sglang.address) == 0
        soon = stub.Generate(
            sgl_generate(tokens=2), metadata=model_md("s", ("x-sim-headers-first", "1"))
        )
        soon_headers = await soon.initial_metadata()
        messages, error = await collect(soon)
    assert dict(headers)["x-sim-worker"] == "sgl-0"
    assert dict(soon_headers)["x-sim-worker"] == "sgl-0"
    assert error is None
    assert len(messages) == 3


async def test_metadata_hygiene(ready: Fleet) -> None:
    gw = ready.gateway
    sent = model_md(
        "s",
        ("x-app-key", "k1"),
        ("traceparent", TRACEPARENT),
        ("tracestate", "vendor=1"),
        ("x-blob-bin", b"\x00\x01"),
        # Keys a gateway must not forward (a direct call to the sim does deliver them).
        ("grpc-custom", "1"),
        ("connection", "close"),
        ("keep-alive", "5"),
        ("proxy-connection", "x"),
        ("host", "example"),
        ("upgrade", "h2c"),
        ("transfer-encoding", "chunked"),
    )
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=sent)
        _, error = await collect(call)
        headers = dict(await call.initial_metadata())
    assert error is None
    seen = set(headers["x-sim-seen-metadata"].split(","))
    # user-agent is the gateway's own channel's (every gRPC client sends one).
    assert seen == {
        "x-model-id",
        "x-app-key",
        "traceparent",
        "tracestate",
        "x-blob-bin",
        "user-agent",
    }
    # The worker's headers reach the client; nothing of the worker's transport does.
    assert not [k for k in headers if k.startswith("grpc-") or k in ("te", "content-type")]


async def test_concurrent_streams_are_relayed_independently(ready: Fleet) -> None:
    async with channel(ready.gateway.address) as ch:
        sgl_stub = sgl_grpc.SglangSchedulerStub(ch)
        vllm_stub = vllm_grpc.VllmEngineStub(ch)
        calls = [
            sgl_stub.Generate(
                sgl_generate(f"cc-{i}", tokens=i + 1),
                metadata=model_md("s", ("x-sim-token-ms", "5")),
            )
            for i in range(12)
        ] + [
            vllm_stub.Generate(
                vllm_generate(f"vc-{i}", tokens=i + 1),
                metadata=model_md("v", ("x-sim-token-ms", "5")),
            )
            for i in range(12)
        ]
        results = await asyncio.wait_for(asyncio.gather(*(collect(c) for c in calls)), 20)
    for i, (messages, error) in enumerate(results):
        tokens = i % 12 + 1
        assert error is None
        assert len(messages) == tokens + 1
        # SGLang's Complete counts them all; vLLM's, a delta, its last chunk's one.
        assert messages[-1].complete.completion_tokens == (tokens if i < 12 else 1)
        if i < 12:
            assert {m.request_id for m in messages} == {f"cc-{i}"}
    assert await wait_idle(ready.sglang.address) == 0
    assert await wait_idle(ready.vllm.address, "vllm") == 0


async def test_undecodable_requests_are_invalid_argument(ready: Fleet) -> None:
    gw = ready.gateway
    garbage = b"\xff\xff\xff"
    async with channel(gw.address) as ch:
        for service in (SGL_SERVICE, VLLM_SERVICE):
            _, error = await collect(ch.unary_stream(f"/{service}/Generate")(garbage))
            assert error is not None
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == "Request bytes are not a valid GenerateRequest"
            assert trailers(error)["x-http-status"] == "400"
        with pytest.raises(aio.AioRpcError) as caught:
            await ch.unary_unary(f"/{SGL_SERVICE}/Embed")(garbage)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "Request bytes are not a valid Embed request"
        with pytest.raises(aio.AioRpcError) as caught:
            await ch.unary_unary(f"/{VLLM_SERVICE}/Abort")(garbage)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "Request bytes are not a valid AbortRequest"

        # The gateway is still there and serving.
        stub = sgl_grpc.SglangSchedulerStub(ch)
        messages, error = await collect(stub.Generate(sgl_generate(), metadata=model_md("s")))
        assert error is None
        assert len(messages) == 5
        vstub = vllm_grpc.VllmEngineStub(ch)
        messages, error = await collect(vstub.Generate(vllm_generate(), metadata=model_md("v")))
        assert error is None
        assert len(messages) == 5


async def test_oversized_multimodal_request_passes_through(ready: Fleet) -> None:
    worker, gw = ready.sglang, ready.gateway
    request = sgl_generate("mm1", tokens=3)
    request.mm_inputs.image_data.append(bytes(range(256)) * (6 * 1024 * 4))  # 6 MiB
    request.mm_inputs.modalities.append("image")
    assert request.ByteSize() > 6 * 1024 * 1024
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(request, metadata=model_md("s"))
        messages, error = await asyncio.wait_for(collect(call), 10)
    assert error is None, error
    assert len(messages) == 4
    assert messages[-1].complete.finish_reason == "length"
    assert await wait_idle(worker.address) == 0
