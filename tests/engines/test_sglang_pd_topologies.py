"""SGLang PD with two decodes on one prefill (1p2d) on real engines, over Mooncake on TCP:
both decodes take traffic under round robin; with one of them down every call is still
served (a failure before the first byte is retried on another pair); a stream whose decode
is killed goes on on the other one (migration: the prefill again, with the tokens so far)
and equals the uninterrupted greedy run.

Three workers for the module beside the session's regular SGLang worker (`sglang`, the
reference): the tier's four, so the session's vLLM worker is stopped first (the next test
that asks for it starts it again)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.engines.worker import EngineWorker
from tests.conftest import Launcher
from tests.engines.conftest import Engines
from tests.support.availability import admin_address, is_ready, list_workers, wait_worker
from tests.support.engines import VOCAB, WAIT_S, logged, prompt, sglang_greedy, streamed
from tests.support.helpers import channel, model_md, sgl_grpc, write_config

Topology = tuple[EngineWorker, list[EngineWorker]]


@pytest.fixture(scope="module")
def one_two(engines: Engines, sglang: EngineWorker) -> Iterator[Topology]:
    for worker in engines.workers:
        if worker.running and worker is not sglang:
            worker.stop()  # room for three more (the session's vLLM worker)
    with engines.group() as started:
        started.append(engines.start("sglang", name="tiny", disaggregation="prefill"))
        for _ in range(2):
            started.append(engines.start("sglang", name="tiny", disaggregation="decode"))
        yield started[0], started[1:]


def started(
    gateway: Launcher, tmp_path: Path, prefill: EngineWorker, decodes: list[EngineWorker]
) -> Any:
    config = write_config(tmp_path, {"models": {"tiny": {"vocab_size": VOCAB}}})
    flags = ["--config", config, "--worker", prefill.url]
    for decode in decodes:
        flags += ["--worker", decode.url]
    return gateway(*flags)


async def all_ready(gw: Any, *workers: EngineWorker) -> None:
    for worker in workers:
        await wait_worker(admin_address(gw), worker.address, is_ready, within_s=WAIT_S)


async def test_both_decodes_take_traffic_and_one_down_costs_no_call(
    one_two: Topology, gateway: Launcher, tmp_path: Path
) -> None:
    prefill, decodes = one_two
    gw = started(gateway, tmp_path, prefill, decodes)
    await all_ready(gw, prefill, *decodes)
    for i in range(4):
        req = sglang_greedy(f"srr-{i}", prompt(100, i), 8)
        got, error = await streamed(gw.address, req, "tiny")
        assert error is None and len(got) == 8
    used = {tuple(logged(gw.log_path, f"srr-{i}")["legs"]["decode"]) for i in range(4)}
    assert {d for legs in used for d in legs} == {d.address for d in decodes}
    down = decodes[1]
    down.kill()
    try:
        for i in range(6):
            req = sglang_greedy(f"sone-down-{i}", prompt(100, 10 + i), 8)
            got, error = await streamed(gw.address, req, "tiny")
            assert error is None and len(got) == 8, error
    finally:
        down.start()
    await all_ready(gw, down)
    got, error = await streamed(gw.address, sglang_greedy("sback", prompt(60, 3), 4), "tiny")
    assert error is None and len(got) == 4


async def test_a_stream_whose_decode_dies_goes_on_on_the_other_and_equals_the_greedy_run(
    sglang: EngineWorker, one_two: Topology, gateway: Launcher, tmp_path: Path
) -> None:
    prefill, decodes = one_two
    gw = started(gateway, tmp_path, prefill, decodes)
    await all_ready(gw, prefill, *decodes)
    tokens_wanted = 400
    wanted, error = await streamed(
        sglang.address, sglang_greedy("smig-ref", prompt(64, 9), tokens_wanted)
    )
    assert error is None and len(wanted) == tokens_wanted
    got: list[int] = []
    killed: EngineWorker | None = None
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sglang_greedy("smig", prompt(64, 9), tokens_wanted),
            metadata=model_md("tiny"),
            timeout=300,
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
        assert got == wanted  # every token once, in order, as if nothing happened
        line = logged(gw.log_path, "smig")
        assert line["code"] == "OK" and line["migrations"], line
    finally:
        if killed is not None:
            killed.start()
