"""The gateway in front of real vLLM gRPC workers, on what the simulator used to get wrong:
usage of streamed calls (vLLM streams deltas) and tenants' token budgets; cancel and Abort,
also with `--processes 2`; a worker killed (-9) and started again; the KV index across that
restart and across a forced gap (a batch over `kv.max_event_bytes`); cache-aware hits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway_sim.client import admin_address, channel, model_md, vllm, vllm_grpc, write_config
from scripts.engines.worker import EngineWorker
from tests.engines.conftest import Engines
from tests.support.availability import is_ready, labels, samples, scrape, wait_worker
from tests.support.engines import greedy, load_on, logged, prompt, wait_idle
from tests.support.launch import Launcher

FOLLOW_S = 2.0  # the bound: events applied within this of the worker's first batch
WAIT_S = 30.0  # bounded waits for a state (a busy 2-core machine runs the engine too)


async def generate(
    address: str, req: Any, metadata: Sequence[tuple[str, str | bytes]] = ()
) -> tuple[list[int], aio.AioRpcError | None]:
    """The token ids a call generated (the chunks' under streaming, the Complete's
    otherwise), and its error if it failed."""
    tokens: list[int] = []
    async with channel(address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(req, metadata=tuple(metadata), timeout=120)
        try:
            async for reply in call:
                if reply.HasField("chunk"):
                    tokens.extend(reply.chunk.token_ids)
                elif not req.stream:
                    tokens.extend(reply.complete.output_ids)
        except aio.AioRpcError as error:
            return tokens, error
    return tokens, None


def kv_events(gw: Any, worker: EngineWorker, kind: str = "stored") -> float:
    found = samples(scrape(gw), "gateway_kv_events_total")
    return found.get(labels(worker=worker.address, kind=kind), 0.0)


def resyncs(gw: Any, worker: EngineWorker) -> dict[str, float]:
    found = samples(scrape(gw), "gateway_kv_resyncs_total")
    return {
        dict(key)["reason"]: value
        for key, value in found.items()
        if dict(key).get("worker") == worker.address
    }


def subscriptions(worker: EngineWorker) -> int:
    """KV event subscriptions the worker has opened (its relay logs each; the log is kept
    across restarts)."""
    text = worker.log_path.read_text(errors="replace") if worker.log_path.exists() else ""
    return text.count("SubscribeKvEvents: subscribed")


async def wait_subscribed(worker: EngineWorker, past: int) -> None:
    """Until the worker has opened a subscription past `past`: a live-only relay sends
    nothing published before it."""
    deadline = time.monotonic() + WAIT_S
    while subscriptions(worker) <= past:
        assert time.monotonic() < deadline, "the gateway never subscribed to the worker's events"
        await asyncio.sleep(0.05)


async def wait_events_past(gw: Any, worker: EngineWorker, before: float) -> float:
    """Seconds until the gateway has applied a stored event past `before`."""
    started = time.monotonic()
    while kv_events(gw, worker) <= before:
        assert time.monotonic() - started < WAIT_S, "the gateway applied no new KV event"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


# -- usage and budgets -----------------------------------------------------------------


async def test_streamed_calls_are_logged_and_charged_the_tokens_the_engine_generated(
    engine: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    """Streamed and unary calls of 32 + 150 tokens, interleaved, two tenants of 600 tokens
    a minute (10 a second come back: a call takes a second or two here): each call's
    request line has the 150 tokens it generated, and the budget refuses the streaming
    tenant where it refuses the unary one. Before the fix a streamed call was settled as
    32 + 1 tokens, and every one was admitted."""
    config = write_config(
        tmp_path,
        {
            "flow": {"trust_tenant_header": True},
            "tenants": {
                "streamer": {"tokens_per_minute": 600},
                "unary": {"tokens_per_minute": 600},
            },
        },
    )
    gw = gateway("--config", config, "--worker", f"{engine.url}?model=tiny&runtime=vllm")
    admitted = {"streamer": 0, "unary": 0}
    started = time.monotonic()
    for turn in range(8):
        for tenant, stream in (("streamer", True), ("unary", False)):
            request_id = f"budget-{tenant}-{turn}"
            tokens, error = await generate(
                gw.address,
                greedy(request_id, prompt(32, turn), 150, stream=stream),
                (*model_md("tiny"), ("x-tenant-id", tenant)),
            )
            if error is not None:
                assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error
                assert "RATE_LIMITED" in str(error.trailing_metadata()) or error.details()
                continue
            admitted[tenant] += 1
            assert len(tokens) == 150
            line = logged(gw.log_path, request_id)
            assert (line["completion_tokens"], line["tenant"]) == (150, tenant)
    print(f"admitted of 8 each: {admitted} in {time.monotonic() - started:.1f} s")
    assert admitted["unary"] < 8, "the calls were too slow for the budget to bite"
    assert admitted["streamer"] < 8
    assert abs(admitted["streamer"] - admitted["unary"]) <= 1


# -- cancel and Abort ------------------------------------------------------------------


async def abort_midway(gw_address: str, engine: EngineWorker, request_id: str) -> None:
    """A long stream through the gateway, aborted through the gateway (on another
    connection) after a few tokens: it ends with finish_reason `abort`, the worker idle."""
    got: list[Any] = []
    async with channel(gw_address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(
            greedy(request_id, prompt(16, 7), 1900), metadata=model_md("tiny"), timeout=120
        )
        async for reply in call:
            got.append(reply)
            if len(got) == 3:
                async with channel(gw_address) as other:
                    await vllm_grpc.VllmEngineStub(other).Abort(
                        vllm.AbortRequest(request_ids=[request_id]),
                        metadata=model_md("tiny"),
                        timeout=10,
                    )
    assert got[-1].HasField("complete") and got[-1].complete.finish_reason == "abort"
    assert len(got) < 1900
    await wait_idle(engine)


async def test_cancel_and_abort_through_the_gateway_free_the_worker(
    engine: EngineWorker, gateway: Launcher
) -> None:
    gw = gateway("--worker", f"{engine.url}?model=tiny&runtime=vllm")
    # A client cancel: the upstream call is cancelled, the engine aborts the request.
    async with channel(gw.address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(
            greedy("cancel-1", prompt(16, 3), 1900), metadata=model_md("tiny"), timeout=120
        )
        seen = 0
        async for _ in call:
            seen += 1
            if seen == 3:
                call.cancel()
                break
    await wait_idle(engine)
    assert logged(gw.log_path, "cancel-1")["code"] == "CANCELLED"
    await abort_midway(gw.address, engine, "abort-1")


async def test_abort_reaches_the_worker_from_either_process(
    engine: EngineWorker, gateway: Launcher
) -> None:
    """`--processes 2`: the Abort may land in the process that does not hold the stream."""
    gw = gateway("--processes", "2", "--worker", f"{engine.url}?model=tiny&runtime=vllm")
    for attempt in range(3):  # new connections: both processes get some of them
        await abort_midway(gw.address, engine, f"abort-p2-{attempt}")


# -- a worker killed and started again; the KV index -------------------------------------


@pytest.fixture(scope="module")
def restartable(engines: Engines) -> Iterator[EngineWorker]:
    """A worker of its own, to kill -9 and start again (model `kvw`); stopped with the
    module (the tier runs at most four workers at once)."""
    worker = engines.start(name="kvw")
    try:
        yield worker
    finally:
        worker.close()


async def repeated_prefix(gw: Any, name: str, tokens: list[int]) -> dict[str, Any]:
    _, error = await generate(gw.address, greedy(name, tokens, 4), model_md("kvw"))
    assert error is None, error
    return logged(gw.log_path, name)


async def test_after_kill_9_and_a_restart_the_index_follows_the_new_engine(
    restartable: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    """The restarted engine's sequence starts over below the old cursor: its events are
    applied within FOLLOW_S of its first batch, and the expected hit of a repeated prefix
    equals what the engine reports cached, before and after the restart."""
    config = write_config(tmp_path, {"default_policy": "cache_aware"})
    opened = subscriptions(restartable)
    gw = gateway("--config", config, "--worker", f"{restartable.url}?model=kvw&runtime=vllm")
    admin = admin_address(gw)
    await wait_worker(admin, restartable.address, is_ready, within_s=WAIT_S)
    await wait_subscribed(restartable, opened)
    tokens = prompt(300, 11)  # two full blocks of 128
    before = kv_events(gw, restartable)
    first = await repeated_prefix(gw, "kv-1", tokens)
    assert (first["expected_cached_tokens"], first["cached_tokens"]) == (0, 0)
    await wait_events_past(gw, restartable, before)
    again = await repeated_prefix(gw, "kv-2", tokens)
    assert (again["expected_cached_tokens"], again["cached_tokens"]) == (256, 256)

    restartable.kill()
    await wait_worker(admin, restartable.address, lambda w: not is_ready(w), within_s=WAIT_S)
    opened = subscriptions(restartable)
    restarted = time.monotonic()
    restartable.start()
    await wait_worker(admin, restartable.address, is_ready, within_s=WAIT_S)
    await wait_subscribed(restartable, opened)
    print(f"restarted, ready and subscribed again in {time.monotonic() - restarted:.0f} s")
    before = kv_events(gw, restartable)
    fresh = await repeated_prefix(gw, "kv-3", tokens)
    # A new engine, an empty cache: the old entries went with the old subscription.
    assert (fresh["expected_cached_tokens"], fresh["cached_tokens"]) == (0, 0)
    took = await wait_events_past(gw, restartable, before)
    print(f"events applied {took:.2f} s after the restarted engine's first call ended")
    assert took <= FOLLOW_S
    warm = await repeated_prefix(gw, "kv-4", tokens)
    assert (warm["expected_cached_tokens"], warm["cached_tokens"]) == (256, 256)


async def test_after_a_forced_miss_the_follower_follows_again_within_one_resubscribe(
    engine: EngineWorker, gateway: Launcher, tmp_path: Path
) -> None:
    """A batch over `kv.max_event_bytes` is refused by the subscription's channel: the
    follower tries its cursor once (OUT_OF_RANGE: the relay cannot replay), subscribes from
    0, and applies the next batches; no loop."""
    config = write_config(
        tmp_path, {"default_policy": "cache_aware", "kv": {"max_event_bytes": 2048}}
    )
    opened = subscriptions(engine)
    gw = gateway("--config", config, "--worker", f"{engine.url}?model=tiny&runtime=vllm")
    await wait_worker(admin_address(gw), engine.address, is_ready, within_s=WAIT_S)
    await wait_subscribed(engine, opened)
    opened = subscriptions(engine)
    _, error = await generate(gw.address, greedy("miss-big", prompt(1280, 5), 2), model_md("tiny"))
    assert error is None  # 10 blocks in one stored event: some 3 KB, over the cap
    deadline = time.monotonic() + WAIT_S
    while "too_large" not in resyncs(gw, engine):
        assert time.monotonic() < deadline, "the oversized batch was not refused"
        await asyncio.sleep(0.05)
    await wait_subscribed(engine, opened)  # from 0 again, once the cursor was refused
    small = prompt(256, 9)  # two blocks: well within the cap
    before = kv_events(gw, engine)
    _, error = await generate(gw.address, greedy("miss-1", small, 2), model_md("tiny"))
    assert error is None
    await wait_events_past(gw, engine, before)
    _, error = await generate(gw.address, greedy("miss-2", small, 2), model_md("tiny"))
    line = logged(gw.log_path, "miss-2")
    # Two whole blocks: the engine computes the prompt's last token again, so the block
    # holding it is no hit, and the gateway expects exactly that.
    assert (line["expected_cached_tokens"], line["cached_tokens"]) == (128, 128)
    counted = resyncs(gw, engine)
    print(f"resyncs after the forced miss: {counted}")
    assert sum(counted.values()) <= 3, counted


# -- migration ---------------------------------------------------------------------------


async def test_a_greedy_stream_whose_worker_is_killed_goes_on_token_for_token(
    engine: EngineWorker, restartable: EngineWorker, gateway: Launcher
) -> None:
    """Two real workers serve model `mig`; a greedy stream's worker is SIGKILLed some
    tokens in: the client's stream goes on on the other worker, and its tokens are exactly
    what an uninterrupted greedy run of the same request gives."""
    tokens = prompt(40, 21)
    length = 1500  # long enough to be running when its worker is found and killed
    expected, error = await generate(engine.address, greedy("mig-ref", tokens, length))
    assert error is None and len(expected) == length
    gw = gateway(
        "--worker", f"{engine.url}?model=mig&runtime=vllm",
        "--worker", f"{restartable.url}?model=mig&runtime=vllm",
    )  # fmt: skip
    admin = admin_address(gw)
    for worker in (engine, restartable):
        await wait_worker(admin, worker.address, is_ready, within_s=WAIT_S)
    got: list[int] = []
    async with channel(gw.address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(
            greedy("mig-1", tokens, length), metadata=model_md("mig"), timeout=300
        )
        while len(got) < 16:
            reply = await call.read()
            assert reply is not aio.EOF
            got.extend(reply.chunk.token_ids)
        loads = {w: await load_on(w) for w in (engine, restartable)}
        [serving] = [w for w, running in loads.items() if running]
        serving.kill()  # kill -9, some tokens into the stream
        read_before = len(got)
        while (reply := await call.read()) is not aio.EOF:
            if reply.HasField("chunk"):
                got.extend(reply.chunk.token_ids)
        assert await call.code() is grpc.StatusCode.OK
    line = logged(gw.log_path, "mig-1")
    print(f"killed {serving.address} once {read_before} of {length} tokens were read")
    assert got == expected  # token for token, none twice, none lost
    assert (line["migrations"], line["completion_tokens"]) == (1, length)
    if serving is restartable:  # the shared `engine` is started again by engine_alive
        restartable.start()
