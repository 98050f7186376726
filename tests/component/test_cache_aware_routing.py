"""Cache-aware placement against simulated workers with real prefix caches: with KV
events, without them (placements teach the index), namespaces, data-parallel ranks, the
prefill leg of SGLang PD, vLLM, and a removed worker's entries."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from structlog.testing import capture_logs

from gateway.admin.v1 import admin_pb2, admin_pb2_grpc
from gateway.app.server import Gateway
from gateway.kv.prefix import Prefix
from gateway.upstream.load.kv_events import FollowState
from gateway_sim.client import collect, model_md
from tests.support.inproc import Sim, client, gateway, idle
from tests.support.inproc import sim as bare_sim
from tests.support.waits import until

M = model_md("m")
# 4 full blocks and a token: an engine's hit stops short of the prompt's last token.
PROMPT = list(range(500, 565))
OTHER = list(range(900, 965))
# The simulators these tests were written for: blocks of 16, token ids past the tiny
# model's vocabulary, the relay that sends a snapshot at once (the tests wait for
# the gateway to follow before any call).
SIM_FLAGS = ("--block-size", "16", "--vocab-size", "32000")


def sim(*flags: str) -> contextlib.AbstractAsyncContextManager[Sim]:
    return bare_sim(*SIM_FLAGS, *flags)


CACHE_AWARE: dict[str, Any] = {"default_policy": "cache_aware"}


def sgl_request(tokens: list[int], request_id: str = "r", **extra: Any) -> Any:
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=tokens),
        sampling_params=sgl.SamplingParams(max_new_tokens=2),
        stream=True,
        **extra,
    )


async def generate(ch: aio.Channel, request: Any) -> tuple[str, int]:
    """The worker that answered and the cached tokens it reported."""
    call = sgl_grpc.SglangSchedulerStub(ch).Generate(request, metadata=M)
    messages, error = await collect(call)
    assert error is None, error
    worker = dict(await call.initial_metadata())["x-sim-worker"]
    return worker, messages[-1].complete.cached_tokens


def url(s: Sim, runtime: str = "sglang", **extra: Any) -> str:
    return s.url(model="m", runtime=runtime, **extra)


async def following(gw: Gateway, *sims: Sim) -> None:
    await until(
        lambda: all(
            gw.parts.fleet.followers[s.address].state is FollowState.FOLLOWING for s in sims
        )
    )


@contextlib.asynccontextmanager
async def two_workers() -> AsyncIterator[tuple[Gateway, aio.Channel, str, Sim]]:
    """Workers a and b behind a cache-aware gateway, PROMPT sent once and its stored
    event in the index: (gateway, channel, the worker's name, its Sim)."""
    async with (
        sim("--model", "m", "--name", "a") as a,
        sim("--model", "m", "--name", "b") as b,
        gateway(url(a), url(b), **CACHE_AWARE) as gw,
        client(gw) as ch,
    ):
        await following(gw, a, b)
        first, cached = await generate(ch, sgl_request(PROMPT, "p0"))
        assert cached == 0
        holder = a if first == "a" else b
        await until(lambda: gw.parts.fleet.kv_index.size(holder.address) == 4)  # its event
        yield gw, ch, first, holder


async def test_with_kv_events_a_prompt_goes_where_it_is_cached() -> None:
    async with two_workers() as (gw, ch, first, _):
        with capture_logs() as logs:
            for i in range(4):
                assert await generate(ch, sgl_request(PROMPT, f"p{i + 1}")) == (first, 64)
        expected = [e["expected_cached_tokens"] for e in logs if e.get("event") == "request"]
        assert expected == [64] * 4
        # A prompt cached nowhere goes by load and rotation: the other worker is free.
        other, cached = await generate(ch, sgl_request(OTHER, "o0"))
        assert (other != first, cached) == (True, 0)
        await idle(gw)


async def test_without_kv_events_placements_teach_the_index() -> None:
    async with (
        sim("--model", "m", "--name", "a", "--no-kv-events") as a,
        sim("--model", "m", "--name", "b", "--no-kv-events") as b,
        gateway(url(a), url(b), **CACHE_AWARE) as gw,
        client(gw) as ch,
    ):
        await until(
            lambda: all(
                f.state is FollowState.UNSUPPORTED for f in gw.parts.fleet.followers.values()
            )
        )
        first, _ = await generate(ch, sgl_request(PROMPT, "p0"))
        for i in range(3):
            assert await generate(ch, sgl_request(PROMPT, f"p{i + 1}")) == (first, 64)
        assert not gw.parts.fleet.kv_index.exact(a.address)


async def test_namespaces_sharing_token_ids_never_hit_each_other() -> None:
    async with (
        sim("--model", "m", "--name", "a") as a,
        gateway(url(a), **CACHE_AWARE) as gw,
        client(gw) as ch,
    ):
        await following(gw, a)
        assert await generate(ch, sgl_request(PROMPT, "f0", lora_id="finance")) == ("a", 0)
        await until(lambda: gw.parts.fleet.kv_index.size(a.address) == 4)
        assert await generate(ch, sgl_request(PROMPT, "l0", lora_id="legal")) == ("a", 0)
        assert await generate(ch, sgl_request(PROMPT, "b0")) == ("a", 0)
        assert await generate(ch, sgl_request(PROMPT, "f1", lora_id="finance")) == ("a", 64)
        index = gw.parts.fleet.kv_index
        assert index.matched_tokens(Prefix(PROMPT, "lora:finance"), [a.address], 0) == {
            (a.address, 0): 64
        }


async def test_a_data_parallel_worker_is_sent_to_the_rank_holding_the_prompt() -> None:
    async with (
        sim("--model", "m", "--name", "a", "--dp-ranks", "2") as a,
        gateway(url(a), **CACHE_AWARE) as gw,
        client(gw) as ch,
    ):
        await following(gw, a)
        # Cache the prompt on rank 1 behind the gateway's back, straight to the worker.
        async with aio.insecure_channel(a.address) as direct:
            assert await generate(direct, sgl_request(PROMPT, "d0", data_parallel_rank=1)) == (
                "a",
                0,
            )
        await until(lambda: gw.parts.fleet.kv_index.size(a.address) == 4)
        assert await generate(ch, sgl_request(PROMPT, "g0")) == ("a", 64)  # rank 1 it was


async def test_sglang_pd_places_the_prefill_leg_cache_aware() -> None:
    pd = ("--model", "m", "--role")
    async with (
        sim(*pd, "prefill", "--name", "p1") as p1,
        sim(*pd, "prefill", "--name", "p2") as p2,
        sim(*pd, "decode", "--name", "d") as d,
    ):
        urls = [url(p, role="prefill", bootstrap_port=p.side["bootstrap"]) for p in (p1, p2)]
        async with gateway(*urls, url(d, role="decode"), **CACHE_AWARE) as gw, client(gw) as ch:
            await following(gw, p1, p2)
            with capture_logs() as logs:
                for i in range(4):
                    worker, _ = await generate(ch, sgl_request(PROMPT, f"pd{i}"))
                    assert worker == "d"
                    if i == 0:
                        prefill = next(
                            e["legs"]["prefill"][0] for e in logs if e.get("event") == "request"
                        )

                        def cached(p: str = prefill) -> bool:
                            return gw.parts.fleet.kv_index.size(p) == 4

                        await until(cached)
            prefills = [e["legs"]["prefill"] for e in logs if e.get("event") == "request"]
            assert len(prefills) == 4 and all(p == prefills[0] for p in prefills)
            expected = [e["expected_cached_tokens"] for e in logs if e.get("event") == "request"]
            assert expected == [0, 64, 64, 64]


async def test_vllm_workers_route_cache_aware_too() -> None:
    async with (
        sim("--runtime", "vllm", "--model", "m", "--name", "a") as a,
        sim("--runtime", "vllm", "--model", "m", "--name", "b") as b,
        gateway(url(a, "vllm"), url(b, "vllm"), **CACHE_AWARE) as gw,
        client(gw) as ch,
    ):
        await following(gw, a, b)
        stub = vllm_grpc.VllmEngineStub(ch)

        async def ask(request_id: str) -> tuple[str, int]:
            request = vllm.GenerateRequest(
                request_id=request_id,
                tokenized=vllm.TokenizedInput(input_ids=PROMPT),
                sampling_params=vllm.SamplingParams(max_tokens=2),
                stream=True,
            )
            call = stub.Generate(request, metadata=M)
            messages, error = await collect(call)
            assert error is None
            worker = dict(await call.initial_metadata())["x-sim-worker"]
            return worker, messages[-1].complete.cached_tokens

        first, _ = await ask("v0")
        holder = a if first == "a" else b
        await until(lambda: gw.parts.fleet.kv_index.size(holder.address) == 4)
        assert [await ask(f"v{i}") for i in range(1, 4)] == [(first, 64)] * 3


def sessions_trace(seed: int = 3) -> list[tuple[str, list[int]]]:
    """(LoRA, prompt) per request: 4 tenants with a 128-token system prompt (one on a
    LoRA adapter), 8 sessions of 6 turns of 32 tokens each, interleaved; 312 blocks in
    all against 2 workers of 32 blocks."""
    rng = random.Random(seed)
    systems = [[rng.randrange(30_000) for _ in range(128)] for _ in range(4)]
    loras = ["", "", "", "adapter-a"]
    sessions = [(t % 4, list(systems[t % 4])) for t in range(8)]
    trace = []
    for _ in range(6):
        for tenant, history in rng.sample(sessions, len(sessions)):
            history += [rng.randrange(30_000) for _ in range(32)]
            trace.append((loras[tenant], list(history)))
    return trace


@pytest.mark.parametrize("events", [True, False])
async def test_expected_cached_tokens_agree_with_the_engines_when_caches_evict(
    events: bool,
) -> None:
    """The gateway's expected hit against the cached tokens the engines report, over a
    multi-tenant trace whose working set is several times the workers' caches: with KV
    events (what they show stored), and without (a cache of the size the workers report,
    after the gateway's placements)."""
    small = ("--model", "m", "--kv-blocks", "32")
    settings: dict[str, Any] = {"default_policy": "cache_aware", "kv.events": events}
    async with (
        sim(*small, "--name", "a") as a,
        sim(*small, "--name", "b") as b,
        gateway(url(a), url(b), **settings) as gw,
        client(gw) as ch,
    ):
        if events:
            await following(gw, a, b)
        else:  # each worker's size comes with its load report: 32 blocks of 16
            await until(
                lambda: all(w.load and w.load.kv_tokens == 512 for w in gw.parts.fleet.registry)
            )
        reported = 0
        with capture_logs() as logs:
            for i, (lora, tokens) in enumerate(sessions_trace()):
                request = sgl_request(tokens, f"t{i}", lora_id=lora)
                reported += (await generate(ch, request))[1]
        expected = sum(e["expected_cached_tokens"] for e in logs if e.get("event") == "request")
        if events:
            evictions = sum(f.events.get("removed", 0) for f in gw.parts.fleet.followers.values())
            assert evictions > 0
        assert reported > 0
        assert abs(expected - reported) <= 0.05 * reported, (expected, reported)


async def test_a_removed_worker_leaves_the_index() -> None:
    async with two_workers() as (gw, ch, first, holder):
        worker = gw.parts.fleet.registry.get(holder.address)
        assert worker is not None
        await gw.parts.fleet.remove(worker, drain_timeout_s=1)
        assert gw.parts.fleet.kv_index.size(holder.address) == 0
        assert holder.address not in gw.parts.fleet.followers
        survivor, cached = await generate(ch, sgl_request(PROMPT, "p1"))
        assert (survivor != first, cached) == (True, 0)


async def test_kv_metrics_and_admin_show_the_index() -> None:
    async with (
        sim("--model", "m", "--name", "a") as a,
        gateway(url(a), **CACHE_AWARE) as gw,
        client(gw) as ch,
    ):
        await following(gw, a)
        await generate(ch, sgl_request(PROMPT, "p0"))
        await until(lambda: gw.parts.fleet.kv_index.size(a.address) == 4)
        await generate(ch, sgl_request(PROMPT, "p1"))
        sample = gw.parts.metrics.prometheus.get_sample_value
        assert sample("gateway_kv_index_blocks", {"worker": a.address}) == 4
        # SGLang stores a page per event: four blocks, four events.
        assert sample("gateway_kv_events_total", {"worker": a.address, "kind": "stored"}) == 4
        assert sample("gateway_prompt_tokens_total", {"model": "m"}) == 130
        assert sample("gateway_prefix_hit_tokens_total", {"model": "m"}) == 64
        async with aio.insecure_channel(f"127.0.0.1:{gw.admin_port}") as admin:
            listed = await admin_pb2_grpc.AdminServiceStub(admin).ListWorkers(
                admin_pb2.ListWorkersRequest()
            )
        (shown,) = listed.workers
        assert (shown.kv_index.blocks, shown.kv_index.subscription, shown.kv_index.exact) == (
            4,
            "following",
            True,
        )
