"""The simulated worker's health and information, spoken to over real protos (hosted, or a
real process where the test is about the process: see tests/sim/conftest.py): signals
flipping its health, NOT_SERVING and no gRPC health at all, slow and hanging health, the
info RPCs of either runtime, embeddings, LoRA admin and logprobs."""

from __future__ import annotations

import hashlib
import signal
import time
from datetime import datetime

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim.model import embedding_for, output_tokens
from tests.sim.conftest import SimProcess
from tests.support.sim import StartSim
from tests.support.sim_calls import PROMPT, channel, drain, drain_until_error, vllm_request
from tests.support.waits import WAIT_S, until

SGL_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"


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
        await until(lambda: state_is(not_serving))
        check = await engine.HealthCheck(vllm_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (False, "not serving")
        sim.process.send_signal(signal.SIGUSR2)
        await until(lambda: state_is(serving))
        check = await engine.HealthCheck(vllm_pb2.HealthCheckRequest())
        assert (check.healthy, check.message) == (True, "Health")  # vLLM's servicer's word
    sim.process.send_signal(signal.SIGTERM)
    assert sim.process.wait(WAIT_S) == 0


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
        assert (check.healthy, check.message) == (True, "Health check passed")


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
    # The servicer's own figures for what SGLang never tells it: a default vocabulary,
    # no EOS or PAD ids, and the KV pool's size (4,096 blocks of 128) as the context.
    assert model.is_generation and model.max_context_length == 524_288
    assert model.max_req_input_len == 2042  # one short of the context, less 5
    assert model.vocab_size == 128_256 and list(model.eos_token_ids) == []
    assert (model.bos_token_id, model.pad_token_id) == (1, 0)
    assert (model.model_type, list(model.architectures)) == ("llama", ["LlamaForCausalLM"])

    args = dict(server.server_args.items())
    assert args["model_path"] == "sim/sim-model"
    assert args["served_model_name"] == "sim-model"
    assert args["disaggregation_mode"] == "null"
    assert args["disaggregation_bootstrap_port"] == 8998
    assert (args["tp_size"], args["dp_size"]) == (1, 2)
    assert (args["page_size"], args["context_length"], args["max_running_requests"]) == (
        128,
        2048,
        4096,
    )
    assert server.server_type == "grpc" and server.sglang_version == "sim"
    assert server.active_requests == 0

    assert loads.dp_rank_count == 2
    assert [load.dp_rank for load in loads.loads] == [0, 1]
    for load in loads.loads:
        assert load.num_running_reqs == 0 and load.num_waiting_reqs == 0
        # Its prefix cache's size: the default 4,096 blocks of 128 tokens per rank.
        assert load.max_running_requests == 4096 and load.max_total_num_tokens == 524_288
        assert (load.memory.token_capacity, load.disaggregation.mode) == (524_288, "null")
        assert load.HasField("queues")
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
    assert model.vocab_size == 512 and list(model.eos_token_ids) == [2]
    assert model.max_context_length == model.max_req_input_len == 2048
    assert (model.model_type, model.bos_token_id, model.pad_token_id) == ("llama", 1, 3)
    # The fields the servicer fills from the engine's config, and only those.
    assert (server.block_size, server.kv_cache_dtype, server.model_dtype) == (
        128,
        "auto",
        "torch.float32",
    )
    assert (server.max_num_seqs, server.data_parallel_size) == (128, 1)  # the CPU backend's
    assert (server.multimodal_encoder_dtype, server.constrained_decoding_start) == (
        "float32",
        "first_token",
    )
    assert server.kv_role == server.kv_connector == server.kv_engine_id == ""
    assert server.server_type == "" and server.active_requests == 0
    assert server.uptime_seconds == 0.0 and not server.is_paused
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1 and loads.version == "0.32.0"
    assert loads.loads[0].max_running_requests == 128
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


async def test_vllm_logprobs_and_greedy_n(vllm_sim: SimProcess) -> None:
    """Logprobs as the servicer converts vLLM's: each token's value and its top list;
    the prompt's on the first chunk (streamed) or the Complete (unstreamed), the first
    position without a value. Greedy sampling takes one choice only."""
    streamed = vllm_request(max_tokens=3)
    streamed.sampling_params.logprobs = 2
    streamed.sampling_params.prompt_logprobs = 1
    whole = vllm_request(max_tokens=3, stream=False)
    whole.sampling_params.logprobs = 0
    greedy = vllm_request(max_tokens=3, n=2)
    greedy.sampling_params.temperature = 0.0
    async with channel(vllm_sim) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        chunks = await drain(stub.Generate(streamed))
        [done] = await drain(stub.Generate(whole))
        refused, error = await drain_until_error(stub.Generate(greedy))
    first, *rest, final = chunks
    assert list(first.chunk.input_logprobs.token_ids) == PROMPT
    assert [e.HasField("value") for e in first.chunk.input_logprobs.token_logprobs] == [
        False,
        True,
        True,
    ]
    assert [len(t.token_ids) for t in first.chunk.input_logprobs.top_logprobs] == [0, 1, 1]
    assert not any(m.chunk.HasField("input_logprobs") for m in rest)
    for message in (*chunks[:-1], final):
        part = message.chunk if message.WhichOneof("response") == "chunk" else message.complete
        ids = part.token_ids if message.WhichOneof("response") == "chunk" else part.output_ids
        assert list(part.output_logprobs.token_ids) == list(ids)
        [top] = part.output_logprobs.top_logprobs
        assert len(top.token_ids) == 2 and top.token_ids[0] == ids[0]
    assert not final.complete.HasField("input_logprobs")
    assert list(done.complete.output_logprobs.token_ids) == output_tokens(PROMPT, 3)
    assert len(done.complete.output_logprobs.token_logprobs) == 3
    assert not done.complete.output_logprobs.top_logprobs  # logprobs 0: values only
    assert refused == [] and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "n must be 1 when using greedy sampling, got 2."


async def test_grpc_health_names_an_unknown_service(sglang_sim: SimProcess) -> None:
    async with channel(sglang_sim) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _health(ch, "no.such.Service")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert error.value.details() == "Unknown service: no.such.Service"
