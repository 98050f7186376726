"""End-to-end tests of the simulated worker, spoken to over real protos (hosted, or a real
process where the test is about the process: see tests/sim/conftest.py)."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim.engine import embedding_for, output_tokens
from tests.sim.conftest import SimProcess

SGL_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
PROMPT = [5, 7, 11]

StartSim = Callable[..., SimProcess]


@asynccontextmanager
async def channel(sim: SimProcess) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(sim.address) as ch:
        yield ch


def sgl_request(
    request_id: str = "req",
    *,
    stream: bool = True,
    max_new_tokens: int | None = None,
    n: int = 0,
    input_ids: list[int] = PROMPT,
) -> Any:
    params = sgl_pb2.SamplingParams(n=n)
    if max_new_tokens is not None:
        params.max_new_tokens = max_new_tokens
    return sgl_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=sgl_pb2.TokenizedInput(input_ids=input_ids),
        sampling_params=params,
        stream=stream,
    )


def vllm_request(
    request_id: str = "req", *, stream: bool = True, max_tokens: int | None = None, n: int = 0
) -> Any:
    params = vllm_pb2.SamplingParams(n=n)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    return vllm_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=params,
        stream=stream,
    )


async def drain(call: Any) -> list[Any]:
    return [message async for message in call]


async def drain_until_error(call: Any) -> tuple[list[Any], grpc.aio.AioRpcError]:
    messages: list[Any] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for message in call:
            messages.append(message)
    return messages, info.value


async def read_rest(call: Any) -> list[Any]:
    """Drain a call already read with ``read()`` (gRPC forbids mixing in iteration)."""
    messages: list[Any] = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def running(stub: Any) -> int:
    loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest(dp_rank=0), timeout=5)
    return int(loads.loads[0].num_running_reqs)


def trailers(error: grpc.aio.AioRpcError) -> dict[str, Any]:
    return dict(error.trailing_metadata() or ())


# ------------------------------------------------------------------------------ Generate


async def test_sglang_streaming_generate(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_request("s-1"), metadata=(("x-trace", "t1"),), timeout=10
        )
        messages = await drain(call)
        headers = dict(await call.initial_metadata())
        assert await call.code() == grpc.StatusCode.OK

    expected = output_tokens(PROMPT, 16)
    assert expected[0] == sum(PROMPT) % 32000
    assert len(messages) == 17
    for k, message in enumerate(messages[:-1]):
        assert message.request_id == "s-1"
        assert message.WhichOneof("response") == "chunk"
        assert list(message.chunk.token_ids) == [expected[k]]
        assert message.chunk.prompt_tokens == 3
        assert message.chunk.completion_tokens == k + 1
        assert message.chunk.index == 0
    final = messages[-1]
    assert final.request_id == "s-1"
    assert final.WhichOneof("response") == "complete"
    assert list(final.complete.output_ids) == expected
    assert final.complete.finish_reason == "length"
    assert (final.complete.prompt_tokens, final.complete.completion_tokens) == (3, 16)

    assert headers["x-sim-worker"] == "sgl-shared"
    assert 0 < int(headers["x-sim-deadline-ms"]) <= 10_000
    assert "x-trace" in headers["x-sim-seen-metadata"].split(",")


async def test_sglang_non_streaming_request_max_wins(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_request("s-2", stream=False, max_new_tokens=5), metadata=(("x-sim-tokens", "9"),)
        )
        messages = await drain(call)
        headers = dict(await call.initial_metadata())
    assert len(messages) == 1
    assert list(messages[0].complete.output_ids) == output_tokens(PROMPT, 5)
    assert messages[0].complete.completion_tokens == 5
    assert headers["x-sim-deadline-ms"] == "none"


async def test_vllm_streaming_and_non_streaming(vllm_sim: SimProcess) -> None:
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        streamed = await drain(stub.Generate(vllm_request(max_tokens=4), timeout=10))
        whole = await drain(stub.Generate(vllm_request(stream=False), timeout=10))
        call = stub.Generate(vllm_request(stream=False, max_tokens=0), timeout=10)
        empty = await drain(call)
        assert dict(await call.initial_metadata())["x-sim-worker"] == "vllm-shared"

    assert [m.WhichOneof("response") for m in streamed] == ["chunk"] * 4 + ["complete"]
    assert [m.chunk.token_ids[0] for m in streamed[:-1]] == output_tokens(PROMPT, 4)
    assert streamed[-1].complete.completion_tokens == 4
    assert len(whole) == 1
    assert list(whole[0].complete.output_ids) == output_tokens(PROMPT, 16)
    assert whole[0].complete.finish_reason == "length"
    assert len(empty) == 1 and list(empty[0].complete.output_ids) == []


async def test_n2_indices(sglang_sim: SimProcess, vllm_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        sgl = await drain(
            sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_request(max_new_tokens=3, n=2))
        )
    async with channel(vllm_sim) as ch:
        vl = await drain(vllm_grpc.VllmEngineStub(ch).Generate(vllm_request(max_tokens=3, n=2)))
    for messages in (sgl, vl):
        assert len(messages) == 2 * 3 + 2
        chunks = [m.chunk for m in messages if m.WhichOneof("response") == "chunk"]
        completes = [m.complete for m in messages if m.WhichOneof("response") == "complete"]
        assert sorted(c.index for c in chunks) == [0, 0, 0, 1, 1, 1]
        assert sorted(c.index for c in completes) == [0, 1]
        assert all(c.completion_tokens == 3 for c in completes)


# ------------------------------------------------------------------------------ failures


async def test_fail_at_start_is_trailers_only(start_sim: StartSim) -> None:
    sim = start_sim("--fail-code", "UNAVAILABLE", "--name", "bad-worker")
    async with channel(sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_request(), timeout=5)
        messages, error = await drain_until_error(call)
        headers = dict(await call.initial_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as embed_error:
            await stub.Embed(
                sgl_pb2.EmbedRequest(tokenized=sgl_pb2.TokenizedInput(input_ids=PROMPT))
            )
        assert await running(stub) == 0
    assert messages == []
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "simulated failure"
    assert trailers(error)["x-sim-failure"] == "bad-worker"
    assert "x-sim-worker" not in headers
    assert embed_error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert trailers(embed_error.value)["x-sim-failure"] == "bad-worker"


async def test_fail_after_k_messages(start_sim: StartSim) -> None:
    sim = start_sim("--runtime", "vllm", "--fail-code", "internal", "--fail-after", "2")
    async with channel(sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        call = stub.Generate(vllm_request(max_tokens=8))
        messages, error = await drain_until_error(call)
        headers = dict(await call.initial_metadata())
        # Shorter than the trigger point: all messages, then the failure anyway.
        short, short_error = await drain_until_error(stub.Generate(vllm_request(stream=False)))
    assert len(messages) == 2
    assert error.code() == grpc.StatusCode.INTERNAL
    assert trailers(error)["x-sim-failure"] == f"vllm@{sim.address}"
    assert headers["x-sim-worker"] == f"vllm@{sim.address}"
    assert len(short) == 1
    assert short_error.code() == grpc.StatusCode.INTERNAL


async def test_per_request_overrides(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        failing = (
            ("x-sim-fail-code", "FAILED_PRECONDITION"),
            ("x-sim-fail-after", "3"),
            ("x-sim-tokens", "10"),
        )
        messages, error = await drain_until_error(stub.Generate(sgl_request(), metadata=failing))
        short = await drain(stub.Generate(sgl_request(), metadata=(("x-sim-tokens", "4"),)))
        started = time.monotonic()
        timed = await drain(
            stub.Generate(
                sgl_request(max_new_tokens=4),
                metadata=(("x-sim-ttft-ms", "60"), ("x-sim-token-ms", "30")),
            )
        )
        elapsed = time.monotonic() - started
        bad, bad_error = await drain_until_error(
            stub.Generate(sgl_request(), metadata=(("x-sim-tokens", "many"),))
        )
        # The worker's own behaviour is untouched by the overrides above.
        plain = await drain(stub.Generate(sgl_request()))
    assert len(messages) == 3
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trailers(error)["x-sim-failure"] == "sgl-shared"
    assert len(short) == 5
    assert len(timed) == 5 and elapsed >= 0.15
    assert bad == [] and bad_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-sim-tokens" in (bad_error.details() or "")
    assert len(plain) == 17


@pytest.mark.sim_processes  # the process exits
async def test_exit_after_kills_process_mid_stream(start_sim: StartSim) -> None:
    sim = start_sim("--exit-after", "3")
    async with channel(sim) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_request(), timeout=10)
        messages, error = await drain_until_error(call)
    assert len(messages) == 3
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert sim.process.wait(5) == 1


# ------------------------------------------------------------------- abort, cancel, stall


async def test_sglang_abort_ends_stream(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(
            sgl_request("ab-1", max_new_tokens=1000),
            metadata=(("x-sim-token-ms", "20"),),
            timeout=10,
        )
        first = [await call.read(), await call.read()]
        response = await stub.Abort(sgl_pb2.AbortRequest(request_id="ab-1"))
        rest = await read_rest(call)
        missing = await stub.Abort(sgl_pb2.AbortRequest(request_id="no-such-request"))
        assert await call.code() == grpc.StatusCode.OK
        assert await running(stub) == 0
    assert (response.success, response.message) == (True, "")
    assert (missing.success, missing.message) == (False, "request not found")
    final = rest[-1]
    assert final.WhichOneof("response") == "complete"
    assert final.complete.finish_reason == "abort"
    assert 2 <= final.complete.completion_tokens < 1000
    assert len(first) + len(rest) == final.complete.completion_tokens + 1


async def test_vllm_abort_stalled_and_streaming(vllm_sim: SimProcess) -> None:
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        stalled = stub.Generate(vllm_request("v-stall"), metadata=(("x-sim-stall", "1"),))
        slow = stub.Generate(vllm_request("v-slow"), metadata=(("x-sim-token-ms", "50"),))
        await slow.read()
        await eventually(lambda: _running_is(stub, 2))
        await stub.Abort(vllm_pb2.AbortRequest(request_ids=["v-stall", "v-slow", "v-none"]))
        stalled_messages = await drain(stalled)
        slow_rest = await read_rest(slow)
        assert await running(stub) == 0
    assert len(stalled_messages) == 1
    assert stalled_messages[0].complete.finish_reason == "abort"
    assert list(stalled_messages[0].complete.output_ids) == []
    assert slow_rest[-1].complete.finish_reason == "abort"


async def _running_is(stub: Any, count: int) -> bool:
    return await running(stub) == count


async def test_cancel_returns_active_count_to_zero(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        stalled = stub.Generate(sgl_request("c-1"), metadata=(("x-sim-stall", "1"),))
        slow = stub.Generate(sgl_request("c-1"), metadata=(("x-sim-token-ms", "50"),))
        await slow.read()
        await eventually(lambda: _running_is(stub, 2))
        info = await stub.GetServerInfo(sgl_pb2.GetServerInfoRequest())
        assert info.active_requests == 2
        stalled.cancel()
        slow.cancel()
        await eventually(lambda: _running_is(stub, 0))


async def test_stall_until_client_deadline(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_request(), metadata=(("x-sim-stall", "1"),), timeout=0.3)
        messages, error = await drain_until_error(call)
        with pytest.raises(grpc.aio.AioRpcError) as embed_error:
            await stub.Embed(
                sgl_pb2.EmbedRequest(tokenized=sgl_pb2.TokenizedInput(input_ids=PROMPT)),
                metadata=(("x-sim-stall", "1"),),
                timeout=0.3,
            )
        await eventually(lambda: _running_is(stub, 0))
    assert messages == []
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert embed_error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


# ------------------------------------------------------------------------------ health


async def _health(ch: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(ch)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


@pytest.mark.sim_processes  # signals
async def test_signals_flip_health_and_sigterm_exits_zero(start_sim: StartSim) -> None:
    sim = start_sim("--runtime", "vllm")
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        (health_pb2.HealthCheckResponse.NOT_SERVING),
    )
    async with channel(sim) as ch:
        engine = vllm_grpc.VllmEngineStub(ch)

        async def state_is(status: int) -> bool:
            return await _health(ch, "") == status and await _health(ch, VLLM_SERVICE) == status

        assert await state_is(serving)
        sim.process.send_signal(signal.SIGUSR1)
        await eventually(lambda: state_is(not_serving))
        check = await engine.HealthCheck(vllm_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (False, "not serving")
        sim.process.send_signal(signal.SIGUSR2)
        await eventually(lambda: state_is(serving))
        check = await engine.HealthCheck(vllm_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (True, "ok")
    sim.process.send_signal(signal.SIGTERM)
    assert sim.process.wait(5) == 0


async def test_not_serving_and_no_grpc_health(start_sim: StartSim) -> None:
    down = start_sim("--not-serving")
    bare = start_sim("--no-grpc-health")
    async with channel(down) as ch:
        assert await _health(ch, SGL_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await _health(ch, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        check = await sgl_grpc.SglangSchedulerStub(ch).HealthCheck(sgl_pb2.HealthCheckRequest())
        assert not check.healthy
    async with channel(bare) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _health(ch, "")
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        check = await sgl_grpc.SglangSchedulerStub(ch).HealthCheck(sgl_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (True, "ok")


# ------------------------------------------------------------------------- info and admin


async def test_sglang_info_rpcs(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        model = await stub.GetModelInfo(sgl_pb2.GetModelInfoRequest())
        server = await stub.GetServerInfo(sgl_pb2.GetServerInfoRequest())
        loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest())
        rank1 = await stub.GetLoads(sgl_pb2.GetLoadsRequest(dp_rank=1))
        chunks = await drain(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert model.served_model_name == "sim-model"
    assert model.model_path == model.tokenizer_path == "sim/sim-model"
    assert model.is_generation and model.max_context_length == 8192
    assert model.vocab_size == 32000 and list(model.eos_token_ids) == [2]

    args = dict(server.server_args.items())
    assert args["model_path"] == "sim/sim-model"
    assert args["served_model_name"] == "sim-model"
    assert args["disaggregation_mode"] == "null"
    assert args["disaggregation_bootstrap_port"] == 8998
    assert (args["tp_size"], args["dp_size"]) == (1, 2)
    assert server.server_type == "grpc" and server.sglang_version == "sim"
    assert server.active_requests == 0

    assert loads.dp_rank_count == 2
    assert [load.dp_rank for load in loads.loads] == [0, 1]
    for load in loads.loads:
        assert load.num_running_reqs == 0 and load.num_waiting_reqs == 0
        # Its prefix cache's size: the default 4,096 blocks of 16 tokens per rank.
        assert load.max_running_requests == 256 and load.max_total_num_tokens == 65_536
        assert load.token_usage == 0.0
    assert loads.HasField("aggregate") and loads.aggregate.total_running_reqs == 0
    datetime.fromisoformat(loads.timestamp)
    assert [load.dp_rank for load in rank1.loads] == [1]

    assert len(chunks) == 2
    assert chunks[0].sha256 == ""
    digest = hashlib.sha256(b"".join(c.data for c in chunks)).hexdigest()
    assert chunks[1].sha256 == digest


async def test_vllm_info_rpcs(vllm_sim: SimProcess) -> None:
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        model = await stub.GetModelInfo(vllm_pb2.GetModelInfoRequest())
        server = await stub.GetServerInfo(vllm_pb2.GetServerInfoRequest())
        loads = await stub.GetLoads(vllm_pb2.GetLoadsRequest())
        chunks = await drain(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
        flush = await stub.FlushCache(common_pb2.FlushCacheRequest())
        profile = await stub.StartProfile(common_pb2.StartProfileRequest())
    assert (model.served_model_name, model.model_path) == ("tiny", "sim/tiny")
    assert model.vocab_size == 32000 and list(model.eos_token_ids) == [2]
    assert server.server_type == "vllm-grpc" and server.kv_role == ""
    assert server.data_parallel_size == 1 and server.active_requests == 0
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1
    assert len(chunks) == 2 and chunks[1].sha256
    assert flush.success and "vllm-shared" in flush.message
    assert profile.success


async def test_embed_both_runtimes(sglang_sim: SimProcess, vllm_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        sgl = await sgl_grpc.SglangSchedulerStub(ch).Embed(
            sgl_pb2.EmbedRequest(request_id="e", tokenized=sgl_pb2.TokenizedInput(input_ids=PROMPT))
        )
    async with channel(vllm_sim) as ch:
        vl = await vllm_grpc.VllmEngineStub(ch).Embed(
            vllm_pb2.EmbedRequest(
                request_id="e", tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT)
            )
        )
    for response in (sgl, vl):
        assert response.embedding_dim == 8 and response.prompt_tokens == 3
        assert list(response.embedding) == embedding_for(PROMPT)


async def test_admin_lora(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        loaded = await stub.LoadLoRAAdapter(
            sgl_pb2.LoadLoRAAdapterRequest(lora_name="a", lora_path="/l/a", lora_id="id-a")
        )
        listed = await stub.ListLoadedLoRAAdapters(sgl_pb2.ListLoadedLoRAAdaptersRequest())
        unloaded = await stub.UnloadLoRAAdapter(
            sgl_pb2.UnloadLoRAAdapterRequest(lora_name="a", lora_id="id-a")
        )
        again = await stub.UnloadLoRAAdapter(sgl_pb2.UnloadLoRAAdapterRequest(lora_name="a"))
        stop = await stub.StopProfile(common_pb2.StopProfileRequest())
    assert loaded.success and list(loaded.loaded_lora_ids) == ["id-a"]
    assert [(a.lora_id, a.lora_name, a.lora_path) for a in listed.loaded_adapters] == [
        ("id-a", "a", "/l/a")
    ]
    assert unloaded.success and list(unloaded.loaded_lora_ids) == []
    assert not again.success
    assert stop.success


async def test_slow_and_hanging_health_and_reported_load(start_sim: StartSim) -> None:
    slow = start_sim("--health-delay-ms", "300", "--load-waiting", "7", "--load-token-usage", "0.8")
    hung = start_sim("--health-hang")
    request = health_pb2.HealthCheckRequest(service=SGL_SERVICE)
    async with channel(slow) as ch:
        started = time.monotonic()
        reply = await health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started >= 0.3
        loads = await sgl_grpc.SglangSchedulerStub(ch).GetLoads(sgl_pb2.GetLoadsRequest())
        assert loads.loads[0].num_waiting_reqs == 7
        assert loads.loads[0].token_usage == pytest.approx(0.8)
    async with channel(hung) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_pb2_grpc.HealthStub(ch).Check(request, timeout=0.5)
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
