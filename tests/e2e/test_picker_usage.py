"""Token counts of the calls the picker places (real processes: simulated workers,
`gateway serve --picker-listen`, Envoy with `gateway envoy-config`'s bootstrap). Envoy
relays the answers; its Lua filter keeps each placed Generate's last message (or every
message, where each counts its own tokens) and hands it to the picker on the answer's
trailers (or, with the response body FULL_DUPLEX_STREAMED, the answer passes the picker),
and the picker counts the tokens in the relay's series: what the workers reported, to the
token. The client never sees the trailer that carried them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.picker.answer_lua import TRAILER
from gateway_sim.client import (
    channel,
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
    vllm_generate,
    vllm_grpc,
)
from gateway_sim.envoy import envoy_binary
from gateway_sim.launch import Child, worker_url
from tests.support.helpers import request_events
from tests.support.launch import Launcher
from tests.support.picker import MODES, picker_gateway, with_envoy
from tests.support.processes import scrape
from tests.support.waits import until

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary")

SGL = "sglang.grpc.scheduler.SglangScheduler"
VLLM = "vllm.grpc.engine.VllmEngine"
PROMPT = list(range(1, 41))  # two KV blocks of 16 tokens, and some: the second time, cached


def prompted(request: Any) -> Any:
    request.tokenized.input_ids[:] = PROMPT
    return request


def reported(messages: list[Any], deltas: bool) -> tuple[int, int]:
    """What a worker reported in one call's answer: its completion tokens (the closing
    answers' totals; a vLLM stream's chunks each count their own, its closing answer
    repeats the last) and its cached tokens (the prompt's: the most any answer says)."""
    completion = cached = 0
    for message in messages:
        kind = message.WhichOneof("response")
        part = getattr(message, kind)
        cached = max(cached, part.cached_tokens)
        if (kind == "chunk") == deltas:
            completion += part.completion_tokens
    return completion, cached


@pytest.mark.parametrize("mode", list(MODES))
async def test_placed_calls_count_the_tokens_the_workers_reported(
    mode: str, sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    sglang = sim("--model", "m", "--tokens-per-chunk", "3", "--block-size", "16")
    vllm = sim("--runtime", "vllm", "--model", "v", "--block-size", "16")
    gw = picker_gateway(
        gateway,
        "--worker",
        worker_url(sglang, model="m", runtime="sglang"),
        "--worker",
        worker_url(vllm, model="v", runtime="vllm"),
    )
    envoy = with_envoy(gw, processes, tmp_path, MODES[mode])
    expected = {"m": [0, 0, 0], "v": [0, 0, 0]}  # model -> [completion, cached, prompt]
    calls = 0
    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        sgl_stub, vllm_stub = sgl_grpc.SglangSchedulerStub(ch), vllm_grpc.VllmEngineStub(ch)
        asks = [
            ("m", sgl_stub, sgl_generate("a", tokens=40), False),
            ("m", sgl_stub, sgl_generate("b", tokens=7, stream=False), False),
            ("m", sgl_stub, sgl_generate("c", tokens=5, n=2), False),
            ("v", vllm_stub, vllm_generate("d", tokens=33), True),
            ("v", vllm_stub, vllm_generate("e", tokens=6, stream=False), False),
        ]
        for model, stub, request, deltas in asks * 2:  # the second time, cached
            call = stub.Generate(prompted(request), metadata=model_md(model))
            messages, error = await collect(call)
            assert error is None
            assert TRAILER not in dict(await call.trailing_metadata())
            completion, cached = reported(messages, deltas)
            assert completion > 0
            expected[model][0] += completion
            expected[model][1] += cached
            expected[model][2] += len(PROMPT)
            calls += 1
    assert expected["m"][1] > 0 and expected["v"][1] > 0  # the second time, cached
    served = 'gateway_picker_answers_total{answer="worker"}'
    ended = 'gateway_requests_total{{code="OK",model="{}",rpc="Generate",service="{}"}}'

    def all_ended(samples: dict[str, float]) -> bool:
        return (
            samples.get(ended.format("m", SGL), 0) + samples.get(ended.format("v", VLLM), 0)
            == calls
        )

    # A call is counted as its ext_proc stream ends, just after its client saw the end.
    await until(lambda: all_ended(scrape(gw)), what="every call counted")
    samples = scrape(gw)
    assert samples[served] == calls
    for model, (completion, cached, prompt) in expected.items():
        assert samples[f'gateway_generated_tokens_total{{model="{model}"}}'] == completion
        assert samples[f'gateway_engine_cached_tokens_total{{model="{model}"}}'] == cached
        assert samples[f'gateway_prompt_tokens_total{{model="{model}"}}'] == prompt
        assert samples.get(f'gateway_worker_usage_rejected_total{{model="{model}"}}', 0) == 0
    for worker in (sglang, vllm):
        assert samples[f'gateway_worker_inflight{{worker="{worker.address}"}}'] == 0
    lines = request_events(gw.log_path, "Generate")
    assert len(lines) == calls
    assert all(line["via"] == "picker" and line["completion_tokens"] for line in lines)
    assert sum(line["completion_tokens"] for line in lines) == sum(
        c for c, _, _ in expected.values()
    )
