"""vLLM PD with two workers on one leg (1p2d) on real engines, over NIXL in host memory:
both decodes take traffic under round robin; with one of them down every call is still
served (a failure before the first byte is retried on another pair); a stream whose decode
is killed goes on on the other one (migration) and equals the uninterrupted greedy run.

Three workers for the module (a prefill, two decodes) beside the session's regular one
(`engine`, the reference): the tier's limit of four."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from scripts.engines.worker import EngineWorker
from tests.conftest import Launcher
from tests.engines.conftest import Engines
from tests.support.availability import admin_address, is_ready, list_workers, wait_worker
from tests.support.engines import WAIT_S, greedy, logged, prompt, streamed
from tests.support.helpers import channel, model_md, vllm_grpc


@pytest.fixture(scope="module")
def one_two(engines: Engines) -> Iterator[tuple[EngineWorker, list[EngineWorker]]]:
    with engines.group() as started:
        started.append(engines.start(kv_role="kv_producer", name="tiny"))
        for _ in range(2):
            started.append(engines.start(kv_role="kv_consumer", name="tiny"))
        yield started[0], started[1:]


def started(gateway: Launcher, prefill: EngineWorker, decodes: list[EngineWorker]) -> Any:
    flags = ["--worker", prefill.url]
    for decode in decodes:
        flags += ["--worker", decode.url]
    return gateway(*flags)


async def all_ready(gw: Any, *workers: EngineWorker) -> None:
    for worker in workers:
        await wait_worker(admin_address(gw), worker.address, is_ready, within_s=WAIT_S)


async def test_both_decodes_take_traffic_and_one_down_costs_no_call(
    one_two: tuple[EngineWorker, list[EngineWorker]], gateway: Launcher
) -> None:
    prefill, decodes = one_two
    gw = started(gateway, prefill, decodes)
    await all_ready(gw, prefill, *decodes)
    for i in range(4):
        tokens, error = await streamed(gw.address, greedy(f"rr-{i}", prompt(100, i), 8), "tiny")
        assert error is None and len(tokens) == 8
    used = {tuple(logged(gw.log_path, f"rr-{i}")["legs"]["decode"]) for i in range(4)}
    assert {d for legs in used for d in legs} == {d.address for d in decodes}
    down = decodes[1]
    down.kill()
    try:
        for i in range(6):
            tokens, error = await streamed(
                gw.address, greedy(f"one-down-{i}", prompt(100, 10 + i), 8), "tiny"
            )
            assert error is None and len(tokens) == 8, error
    finally:
        down.start()
    await all_ready(gw, down)


async def test_a_stream_whose_decode_dies_goes_on_on_the_other_and_equals_the_greedy_run(
    engine: EngineWorker,
    one_two: tuple[EngineWorker, list[EngineWorker]],
    gateway: Launcher,
) -> None:
    prefill, decodes = one_two
    gw = started(gateway, prefill, decodes)
    await all_ready(gw, prefill, *decodes)
    tokens_wanted = 400
    reference, error = await streamed(
        engine.address, greedy("mig-ref", prompt(64, 9), tokens_wanted)
    )
    assert error is None and len(reference) == tokens_wanted
    got: list[int] = []
    killed: EngineWorker | None = None
    async with channel(gw.address) as ch:
        call = vllm_grpc.VllmEngineStub(ch).Generate(
            greedy("mig", prompt(64, 9), tokens_wanted), metadata=model_md("tiny"), timeout=300
        )
        async for reply in call:
            if reply.HasField("chunk"):
                got.extend(reply.chunk.token_ids)
            if killed is None and len(got) >= 40:
                listed = await list_workers(admin_address(gw))
                busy = [d for d in decodes if listed[d.address].inflight > 0]
                assert len(busy) == 1, "the stream's decode is not known"
                killed = busy[0]
                killed.kill()
    try:
        assert killed is not None
        assert got == reference  # every token once, in order, as if nothing happened
        line = logged(gw.log_path, "mig")
        assert line["code"] == "OK" and line["migrations"], line
    finally:
        if killed is not None:
            killed.start()
    await asyncio.sleep(0)
