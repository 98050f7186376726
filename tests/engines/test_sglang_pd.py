"""SGLang prefill/decode disaggregation over Mooncake on TCP, behind the gateway, on real
engines (SGLang's CPU engine, 1p1d): the PD catalogue the Rust gateway runs on GPUs.

The pair (a prefill with its bootstrap port, a decode with a running window of 4,
`--max-running-requests 4`) is started once for the module and stopped after it;
`sglang`, the session's regular SGLang worker, gives the reference streams. (The module
runs after the vLLM PD ones, whose three workers beside the session's vLLM worker are the
tier's four: the SGLang worker starts after them.) The gateway
is told only the two addresses: it finds each leg's role and the prefill's bootstrap port
from GetServerInfo, and gives each call (each choice of an n > 1 call) a room of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway_sim.client import admin_address, list_workers, sgl, write_config
from scripts.engines.sglang_worker import SglangWorker
from scripts.engines.worker import EngineWorker
from tests.engines.conftest import Engines
from tests.support.availability import is_ready, wait_worker
from tests.support.engines import (
    CANCEL_WHEN,
    VOCAB,
    WAIT_S,
    burst,
    cancelled,
    choices,
    log_of,
    logged,
    one_by_one,
    prompt,
    sglang_greedy,
    spread,
    streamed,
    until_unavailable,
    wait_idle,
)
from tests.support.launch import Launcher

WINDOW = 4  # the decode's --max-running-requests
SEQUENTIAL = 30
# What a prefill or decode logs when a hand-off does not complete in time.
TRANSFER_TROUBLE = ("timed out", "Timeout", "KVPoll.Failed", "Decode handshake failed")


class Pair:
    def __init__(self, prefill: SglangWorker, decode: SglangWorker) -> None:
        self.prefill, self.decode = prefill, decode

    @property
    def legs(self) -> tuple[SglangWorker, SglangWorker]:
        return self.prefill, self.decode

    def trouble(self) -> list[str]:
        return [
            line
            for worker in self.legs
            for line in log_of(worker).splitlines()
            if any(word in line for word in TRANSFER_TROUBLE)
        ]


@pytest.fixture(scope="module")
def pair(engines: Engines) -> Iterator[Pair]:
    with engines.group() as started:
        started.append(engines.start("sglang", name="tiny", disaggregation="prefill"))
        started.append(
            engines.start(
                "sglang",
                name="tiny",
                disaggregation="decode",
                extra_args=["--max-running-requests", str(WINDOW)],
            )
        )
        prefill, decode = started
        assert isinstance(prefill, SglangWorker) and isinstance(decode, SglangWorker)
        yield Pair(prefill, decode)


def pd_gateway(gateway: Launcher, tmp_path: Path, pair: Pair) -> Any:
    """The gateway in front of the pair, told the tiny model's real vocabulary (this
    servicer's GetModelInfo says 128256 whatever the model: docs/real-engines.md)."""
    config = write_config(tmp_path, {"models": {"tiny": {"vocab_size": VOCAB}}})
    return gateway("--config", config, "--worker", pair.prefill.url, "--worker", pair.decode.url)


async def ready(gw: Any, *workers: EngineWorker) -> None:
    for worker in workers:
        await wait_worker(admin_address(gw), worker.address, is_ready, within_s=WAIT_S)


async def reference(sglang: EngineWorker, rid: str, tokens: list[int], max_new: int = 24) -> Any:
    got, error = await streamed(sglang.address, sglang_greedy(f"ref-{rid}", tokens, max_new))
    assert error is None and len(got) == max_new
    return got


# -- registration and correctness --------------------------------------------------------


async def test_the_legs_register_with_their_roles_and_a_stream_equals_a_regular_workers(
    sglang: EngineWorker, pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    gw = pd_gateway(gateway, tmp_path, pair)
    await ready(gw, *pair.legs)
    listed = await list_workers(admin_address(gw))
    roles = {worker_id: w.role for worker_id, w in listed.items()}
    assert roles[pair.prefill.address] == 2 and roles[pair.decode.address] == 3  # PREFILL, DECODE
    wanted = await reference(sglang, "a", prompt(200, 1))
    for stream in (True, False):
        rid = f"spd-a-{stream}"
        got, error = await streamed(
            gw.address, sglang_greedy(rid, prompt(200, 1), 24, stream), "tiny"
        )
        assert error is None
        assert got == wanted  # greedy: token for token
        line = logged(gw.log_path, rid)
        assert line["completion_tokens"] == 24  # counted once, the decode's
        assert set(line["legs"]) == {"prefill", "decode"} and len(line["rooms"]) == 1


async def test_two_concurrent_calls_each_equal_their_own_reference(
    sglang: EngineWorker, pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    gw = pd_gateway(gateway, tmp_path, pair)
    await ready(gw, *pair.legs)
    prompts = {"spd-b": prompt(180, 2), "spd-c": prompt(220, 3)}
    wanted = {rid: await reference(sglang, rid, tokens) for rid, tokens in prompts.items()}
    results = await asyncio.gather(
        *(
            streamed(gw.address, sglang_greedy(rid, tokens), "tiny")
            for rid, tokens in prompts.items()
        )
    )
    for (rid, _), (got, error) in zip(prompts.items(), results, strict=True):
        assert error is None
        assert got == wanted[rid], rid
    assert wanted["spd-b"] != wanted["spd-c"]  # the prompts lead elsewhere
    rooms = [logged(gw.log_path, rid)["rooms"][0] for rid in prompts]
    assert rooms[0] != rooms[1]


async def test_the_decode_continues_the_prefill_it_met_in_its_room(
    sglang: EngineWorker, pair: Pair
) -> None:
    """Prompt B on the prefill and prompt C on the decode, in one room: the decode's tokens
    are B's, so the KV (and the first token) came over Mooncake from the prefill and were
    not computed from C's tokens."""
    b, c = prompt(160, 4), prompt(160, 5)
    wanted_b, wanted_c = await reference(sglang, "kv-b", b), await reference(sglang, "kv-c", c)
    assert wanted_b != wanted_c
    boot = sgl.DisaggregatedParams(
        bootstrap_host="127.0.0.1", bootstrap_port=pair.prefill.bootstrap_port, bootstrap_room=77
    )
    on_prefill, on_decode = sglang_greedy("kv-b", b), sglang_greedy("kv-c", c)
    on_prefill.disaggregated_params.CopyFrom(boot)
    on_decode.disaggregated_params.CopyFrom(boot)
    (_, prefill_error), (got, error) = await asyncio.gather(
        streamed(pair.prefill.address, on_prefill), streamed(pair.decode.address, on_decode)
    )
    assert prefill_error is None and error is None
    assert got == wanted_b


# -- abandonment -----------------------------------------------------------------------


@pytest.mark.parametrize("when", CANCEL_WHEN)
async def test_a_client_cancel_leaves_both_legs_idle(
    when: str, pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    gw = pd_gateway(gateway, tmp_path, pair)
    await ready(gw, *pair.legs)
    rid = f"spd-cancel-{when.split()[0]}"
    await cancelled(gw.address, sglang_greedy(rid, prompt(300, 6), 1500), when)
    await wait_idle(*pair.legs)
    assert logged(gw.log_path, rid)["code"] == "CANCELLED"
    got, error = await streamed(gw.address, sglang_greedy(f"{rid}-then", prompt(40, 6), 4), "tiny")
    assert error is None and len(got) == 4  # both legs serve on


# -- the decode's window -----------------------------------------------------------------


async def test_a_burst_six_times_the_decode_window_is_served_or_refused_in_time(
    pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    gw = pd_gateway(gateway, tmp_path, pair)
    await ready(gw, *pair.legs)
    before = len(pair.trouble())
    requests = [sglang_greedy(f"sburst-{i}", prompt(120, 20 + i), 200) for i in range(6 * WINDOW)]
    await burst(gw.address, requests, 200)
    await wait_idle(*pair.legs)
    assert pair.trouble()[before:] == []  # no bootstrap or transfer timed out


# -- n > 1: a room per choice ------------------------------------------------------------


async def test_n_4_gets_a_room_per_choice_and_each_choice_is_the_greedy_run(
    sglang: EngineWorker, pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    gw = pd_gateway(gateway, tmp_path, pair)
    await ready(gw, *pair.legs)
    wanted = await reference(sglang, "n4", prompt(100, 11), 12)
    req = sglang_greedy("spd-n4", prompt(100, 11), 12)
    req.sampling_params.n = 4
    by_choice, error = await choices(gw.address, req, "tiny")
    assert error is None
    assert by_choice == {index: wanted for index in range(4)}
    line = logged(gw.log_path, "spd-n4")
    assert line["code"] == "OK" and len(set(line["rooms"])) == 4
    assert line["completion_tokens"] == 4 * 12


# -- sequential calls: no stall ----------------------------------------------------------


async def test_sequential_pd_calls_do_not_stall(
    pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    gw = pd_gateway(gateway, tmp_path, pair)
    await ready(gw, *pair.legs)
    requests = [sglang_greedy(f"sseq-{i}", prompt(200, 40 + i)) for i in range(SEQUENTIAL)]
    took = await one_by_one(gw.address, requests, 24)
    _, slow = spread(f"{SEQUENTIAL} sequential SGLang PD calls", took)
    assert slow == []


# -- failure and rejoin ------------------------------------------------------------------


BOUND_S = 10.0  # disagg.decode_first_message_timeout_s in the failure tests


@pytest.mark.parametrize("leg", ["decode", "prefill"])
async def test_the_only_worker_of_a_leg_down_is_unavailable_at_once_and_rejoins(
    leg: str, pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    """The leg's only worker killed (kill -9): UNAVAILABLE naming the leg, with retry info,
    never NOT_FOUND, never a wait; started again on the same address, it rejoins.

    A decode back on its address serves at once. A prefill back on its address leaves
    SGLang 0.5.23's decode with what it cached of the old one: now and then (2 of 4 runs
    here) every hand-off then waits for ever on both legs (the prefill logs its request
    received, neither leg moves, `Prefill bootstrap failed ... Aborted by AbortReq` at the
    client's cancel) until the decode restarts too. The engine's defect (the Rust
    gateway's catalogue found its mirror image: a prefill crashing when its decode came
    back); the gateway's part is that no client waits on it: with
    `disagg.decode_first_message_timeout_s` a call is answered UNAVAILABLE at the bound.
    The decode is then restarted, and the pair serves."""
    config = write_config(
        tmp_path,
        {
            "models": {"tiny": {"vocab_size": VOCAB}},
            "disagg": {"decode_first_message_timeout_s": BOUND_S},
        },
    )
    gw = gateway("--config", config, "--worker", pair.prefill.url, "--worker", pair.decode.url)
    await ready(gw, *pair.legs)
    down = pair.decode if leg == "decode" else pair.prefill
    down.kill()
    try:
        await until_unavailable(gw.address, sglang_greedy("down", prompt(50, 7), 4), leg)
    finally:
        down.start()
    await ready(gw, down)
    stranded = 0
    for i in range(3):
        began = time.monotonic()
        req = sglang_greedy(f"back-{i}", prompt(50, i), 4)
        got, error = await streamed(gw.address, req, "tiny")
        took = time.monotonic() - began
        if error is None:
            assert len(got) == 4
            continue
        assert leg == "prefill", error  # a decode back on its address serves
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()
        assert "no first message within 10 s" in error.details()
        assert took < 3 * BOUND_S  # the bound, not the client's deadline (120 s)
        stranded += 1
    print(f"\n[{leg} back on its address] {stranded} of 3 calls stranded")
    if stranded:
        pair.decode.kill()
        pair.decode.start()
        await ready(gw, pair.decode)
    got, error = await streamed(gw.address, sglang_greedy("back-last", prompt(50, 9), 4), "tiny")
    assert error is None and len(got) == 4, error
    assert pair.prefill.running and pair.decode.running
