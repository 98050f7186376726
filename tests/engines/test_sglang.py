"""The gateway in front of a real SGLang gRPC worker (SGLang's CPU engine, smg-grpc-servicer):
discovery and health, a greedy stream equal token for token to the worker's own, usage as
SGLang counts it, a client cancel that leaves the worker idle, and an out-of-vocabulary
token id, which crashes an SGLang worker, refused at the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_sim.client import admin_address, channel, model_md, sgl, sgl_grpc, write_config
from scripts.engines.sglang_worker import KV_TOKENS, SGLANG_SERVICE
from scripts.engines.worker import EngineWorker
from tests.support.availability import is_ready, wait_worker
from tests.support.engines import (
    VOCAB,
    WAIT_S,
    load_on,
    logged,
    prompt,
    sglang_greedy,
    streamed,
    wait_idle,
)
from tests.support.launch import Launcher


def bounded_gateway(gateway: Launcher, tmp_path: Path, worker: EngineWorker, *more: str) -> Any:
    """The gateway with the tiny model's real vocabulary as its bound: this servicer's
    GetModelInfo reports 128256 whatever the model (docs/real-engines.md)."""
    config = write_config(tmp_path, {"models": {"tiny": {"vocab_size": VOCAB}}})
    return gateway("--config", config, "--worker", worker.url, *more)


async def test_gateway_discovers_sglang_and_relays_its_greedy_stream(
    sglang: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    gw = bounded_gateway(gateway, tmp_path, sglang)  # model and runtime asked
    worker = await wait_worker(admin_address(gw), sglang.address, is_ready, within_s=WAIT_S)
    assert (worker.model, worker.runtime) == ("tiny", "sglang")
    direct, error = await streamed(sglang.address, sglang_greedy("sgl-direct", prompt(24), 16))
    assert error is None and len(direct) == 16
    req = sglang_greedy("sgl-gateway", prompt(24), 16)
    through, error = await streamed(gw.address, req, "tiny")
    assert error is None
    assert through == direct  # greedy: token for token
    async with aio.insecure_channel(gw.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SGLANG_SERVICE, "models/tiny"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_usage_is_what_sglang_generated_streamed_and_not(
    sglang: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    gw = bounded_gateway(gateway, tmp_path, sglang)
    await wait_worker(admin_address(gw), sglang.address, is_ready, within_s=WAIT_S)
    for stream in (True, False):
        request_id = f"sgl-usage-{stream}"
        req = sglang_greedy(request_id, prompt(32, 3), 40, stream)
        tokens, error = await streamed(gw.address, req, "tiny")
        assert error is None and len(tokens) == 40
        line = logged(gw.log_path, request_id)
        assert line["completion_tokens"] == 40, line


async def test_a_client_cancel_leaves_sglang_idle(
    sglang: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    gw = bounded_gateway(gateway, tmp_path, sglang)
    await wait_worker(admin_address(gw), sglang.address, is_ready, within_s=WAIT_S)
    req = sglang_greedy("sgl-cancel", prompt(16, 5), 1900)
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(req, metadata=model_md("tiny"))
        seen = 0
        async for _ in call:
            seen += 1
            if seen == 3:
                call.cancel()
                break
    assert await load_on(sglang) >= 0
    await wait_idle(sglang)


async def test_an_out_of_vocabulary_id_never_reaches_sglang(
    sglang: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    """One id past the vocabulary crashes an SGLang worker's scheduler (every call on it
    then fails); the gateway refuses it, and the worker stays up and serving."""
    gw = bounded_gateway(gateway, tmp_path, sglang)
    await wait_worker(admin_address(gw), sglang.address, is_ready, within_s=WAIT_S)
    for bad in (VOCAB, VOCAB + 88, 2**31 - 1):
        req = sglang_greedy(f"oov-{bad}", [1, bad, 2], 4)
        tokens, error = await streamed(gw.address, req, "tiny")
        assert error is not None and not tokens
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == (
            f"tokenized.input_ids holds token id {bad}, outside the vocabulary of model "
            f"'tiny' ({VOCAB} ids, 0 to {VOCAB - 1}: models.tiny.vocab_size)"
        )
    assert sglang.running
    tokens, error = await streamed(gw.address, sglang_greedy("after-oov", prompt(8), 4), "tiny")
    assert error is None and len(tokens) == 4


async def test_sglang_model_info_says_a_default_vocabulary(sglang: EngineWorker) -> None:
    """Why the tests tell the gateway the vocabulary: smg-grpc-servicer 0.14.1 takes
    GetModelInfo's vocab_size (and context) from the scheduler's start-up info, which
    SGLang 0.5.23 does not fill, so it says 128256 and the KV pool's size whatever the
    model (its config.json says 512, 2048). When this fails, the servicer reports the
    model's own figures and the gateway's default bound (the workers' smallest
    vocab_size) suffices: drop models.tiny.vocab_size and update docs/real-engines.md."""
    async with channel(sglang.address) as ch:
        info = await sgl_grpc.SglangSchedulerStub(ch).GetModelInfo(
            sgl.GetModelInfoRequest(), timeout=10
        )
    assert (info.vocab_size, info.max_context_length) == (128256, KV_TOKENS)
    assert info.max_req_input_len == 2042  # the model's context, less SGLang's margin


async def test_an_empty_prompt_never_reaches_sglang(
    sglang: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    """An empty `input_ids` crashes an SGLang worker as an out-of-vocabulary id does (its
    rotary embedding cannot reshape 0 tokens); vLLM refuses it itself. Expected: refused
    INVALID_ARGUMENT at the gateway, the worker still serving."""
    gw = bounded_gateway(gateway, tmp_path, sglang)
    await wait_worker(admin_address(gw), sglang.address, is_ready, within_s=WAIT_S)
    tokens, error = await streamed(gw.address, sglang_greedy("sgl-empty", [], 4), "tiny")
    assert error is not None and not tokens
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details() == "The prompt is empty: tokenized.input_ids holds no token id"
    assert sglang.running
    tokens, error = await streamed(gw.address, sglang_greedy("after-empty", prompt(8), 4), "tiny")
    assert error is None and len(tokens) == 4
