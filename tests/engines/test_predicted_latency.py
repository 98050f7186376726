"""`predicted_latency` in front of a real vLLM worker: how far its time to first token
predictions fall from the times the gateway then observes.

A gateway places every call of model `tiny` with `default_policy: predicted_latency` on
the shared worker; a warm-up of WARMUP calls teaches the worker's model, then MEASURED
more calls are each predicted at placement (`predicted_first_message_ms` on the request
line) and observed (`first_message_ms`). The calls mix prompt lengths over the tiny
model's context, fresh prompts and prompts that share a cached prefix (the index expects
the hit: the gateway follows the worker's KV events), alone and in pairs (a call then
waits behind the other's prefill, or decodes beside it). The measure is the median of
|predicted - observed| / observed over the measured calls that have a prediction: at most
MAX_MEDIAN_ERROR. One worker: every call goes to it whatever is predicted, so the
predictions change nothing they are measured on.

What the times are, on two cores: some 10 ms, plus some 20 ms per thousand uncached
prompt tokens and a little per call beside it, and, for one call in five or six, a stall
of some 100 ms (up to 300) that nothing of the call explains (calling the worker
directly shows it too: a serving vLLM worker spins on its queues, 1.5 cores of 2, and its
servicer, the gateway and the client wait for a core). The model fits relative errors
(gateway.upstream.latency), so it predicts the usual time and the stalls stay outside
the median. Error ratios only, no wall-clock bound; but the figure is the tier's, on a
machine that runs it alone: other work on the same cores (a benchmark beside it) stalls
half the calls or more, and no prediction from the call's features comes within 25%
then (measured 38-70%; the best constant in hindsight 38-63%).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway_sim.client import admin_address, channel, model_md, vllm_grpc, write_config
from scripts.engines.worker import EngineWorker
from tests.support.availability import is_ready, wait_worker
from tests.support.engines import (
    VOCAB,
    WAIT_S,
    greedy,
    log_of,
    logged,
    prediction_errors,
    wait_idle,
)
from tests.support.helpers import request_events
from tests.support.launch import Launcher

MAX_MEDIAN_ERROR = 0.25  # the target
WARMUP = 40  # calls before the measured ones (MIN_SEEN is 8; ~33 calls of memory)
MEASURED = 160  # a median of many: a few stalls more or less do not move it
MAX_TOKENS = 8  # a stream of several messages: the model learns only from streams
CONTEXT = 2048  # the tiny model's max_position_embeddings
BLOCK = 128  # vLLM's KV block on CPU: a shared prefix is cached in whole blocks
PREFIXES = (256, 512, 1024)  # shared "system prompts", in whole blocks
PAIRED = 0.4  # the share of waves of two calls at once


@dataclass(frozen=True, slots=True)
class Call:
    request_id: str
    tokens: list[int]


def plan(seed: int, count: int, tag: str, prefixes: Sequence[list[int]]) -> list[list[Call]]:
    """`count` calls in waves of one or two: a third after a shared prefix (a suffix of
    16-512 tokens), the rest fresh prompts of 8 tokens to most of the context, their
    lengths spread evenly on a log scale (as many short calls as long ones)."""
    draw = random.Random(seed)
    waves: list[list[Call]] = []
    made = 0
    while made < count:
        wave = []
        for _ in range(2 if draw.random() < PAIRED and count - made > 1 else 1):
            if draw.random() < 1 / 3:
                head = draw.choice(prefixes)
                tokens = head + fresh(draw, draw.randrange(16, 513))
            else:
                tokens = fresh(draw, round(8 * (CONTEXT // 2 / 8) ** draw.random()))
            wave.append(Call(f"{tag}-{made}", tokens))
            made += 1
        waves.append(wave)
    return waves


def fresh(draw: random.Random, length: int) -> list[int]:
    """Token ids no earlier call sent (a random first block: no prefix shared by chance,
    with this run's other calls or with what earlier tests left in the worker's cache)."""
    return [draw.randrange(4, VOCAB) for _ in range(length)]


async def send(address: str, waves: Sequence[Sequence[Call]]) -> None:
    """Each wave's calls at once, on one channel (a client's), each streamed in full."""
    async with channel(address) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        for wave in waves:
            await asyncio.gather(*(one(stub, call) for call in wave))


async def one(stub: Any, call: Call) -> None:
    req = greedy(call.request_id, call.tokens, MAX_TOKENS)
    tokens = []
    async for reply in stub.Generate(req, metadata=model_md("tiny"), timeout=120):
        if reply.HasField("chunk"):
            tokens.extend(reply.chunk.token_ids)
    assert len(tokens) == MAX_TOKENS


def subscriptions(worker: EngineWorker) -> int:
    """KV event subscriptions the worker has opened (its relay logs each)."""
    return log_of(worker).count("SubscribeKvEvents: subscribed")


async def wait_subscribed(worker: EngineWorker, past: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while subscriptions(worker) <= past:
        assert time.monotonic() < deadline, "the gateway never subscribed to the worker's events"
        await asyncio.sleep(0.05)


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def test_predicted_time_to_first_token_is_within_a_quarter_of_the_observed(
    engine: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    config = write_config(tmp_path, {"default_policy": "predicted_latency"})
    opened = subscriptions(engine)
    gw = gateway("--config", config, "--worker", f"{engine.url}?model=tiny&runtime=vllm")
    await wait_worker(admin_address(gw), engine.address, is_ready, within_s=WAIT_S)
    await wait_subscribed(engine, opened)  # the index sees the worker's cache from here on
    await wait_idle(engine)  # no call an earlier test left running

    run = random.SystemRandom().randrange(1 << 30)  # this run's prompts, none cached yet
    draw = random.Random(run)
    prefixes = [fresh(draw, length) for length in PREFIXES]
    began = time.monotonic()
    await send(gw.address, plan(run + 1, WARMUP, f"pl-warm-{run}", prefixes))
    await send(gw.address, plan(run + 2, MEASURED, f"pl-{run}", prefixes))
    took = time.monotonic() - began
    logged(gw.log_path, f"pl-{run}-{MEASURED - 1}")  # the last call's line is written
    lines = [
        line
        for line in request_events(gw.log_path, "Generate")
        if str(line["request_id"]).startswith(f"pl-{run}-")
    ]
    assert len(lines) == MEASURED and all(line["code"] == "OK" for line in lines)

    found = prediction_errors(lines)
    observed = [line["first_message_ms"] for line in lines]
    median = statistics.median(observed)
    constant = prediction_errors([{**line, "predicted_first_message_ms": median} for line in lines])
    hits = sum(1 for line in lines if line["expected_cached_tokens"])
    misread = sum(1 for line in lines if line["expected_cached_tokens"] != line["cached_tokens"])
    print(
        f"\n[predicted_latency, real vLLM] {len(found)} of {len(lines)} calls predicted: "
        f"error median {statistics.median(found):.1%}, p90 {quantile(found, 0.9):.1%} "
        f"(a constant {median:.1f} ms: median {statistics.median(constant):.1%}, "
        f"p90 {quantile(constant, 0.9):.1%}); first message median {median:.1f} ms, "
        f"p90 {quantile(observed, 0.9):.1f} ms; {hits} expected hits, {misread} misread; "
        f"{WARMUP + MEASURED} calls in {took:.0f} s"
    )
    assert len(found) >= MEASURED * 0.9  # warm: only a cold model predicts nothing
    assert statistics.median(found) <= MAX_MEDIAN_ERROR
