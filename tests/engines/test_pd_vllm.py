"""vLLM prefill/decode disaggregation over NIXL in host memory, behind the gateway, on real
engines: the PD catalogue the Rust gateway runs on GPUs, here on the CPU (1p1d, then 1p2d).

The pair (a kv_producer and a kv_consumer with a running window of 4, `--max-num-seqs 4`)
is started once for the module and stopped after it; `engine`, the session's regular
vLLM worker, gives the reference streams. NIXL's progress thread runs with a delay
(scripts/engines/patches/sitecustomize.py): without it each worker spins a core, and on
two cores calls stall for up to the prefill's 30 s KV lease (docs/real-engines.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway_sim.client import admin_address, channel, list_workers, vllm_grpc, write_config
from scripts.engines.worker import EngineWorker
from tests.engines.conftest import Engines
from tests.support.availability import is_ready, wait_worker
from tests.support.engines import (
    CANCEL_WHEN,
    PREFILL_KV,
    WAIT_S,
    burst,
    cancelled,
    choices,
    greedy,
    log_of,
    logged,
    one_by_one,
    prompt,
    spread,
    streamed,
    until_unavailable,
    wait_idle,
)
from tests.support.helpers import rich_status
from tests.support.launch import Launcher


def invalid_reads(prefill: EngineWorker, prefix: str) -> list[str]:
    """The prefill's complaints of KV blocks a decode read after it let them go, for the
    requests whose ids start with `prefix` (vLLM logs `Potentially invalid KV blocks for
    ... request <id>-<suffix> were retrieved by a decode worker`)."""
    return [
        line
        for line in log_of(prefill).splitlines()
        if "nvalid KV blocks" in line and f"request {prefix}" in line
    ]


WINDOW = 4  # the decode's --max-num-seqs
SEQUENTIAL = 50


class Pair:
    def __init__(self, prefill: EngineWorker, decodes: list[EngineWorker]) -> None:
        self.prefill, self.decodes = prefill, decodes

    @property
    def decode(self) -> EngineWorker:
        return self.decodes[0]

    def urls(self) -> list[str]:
        """Worker flags, roles left to GetServerInfo."""
        flags = ["--worker", self.prefill.url]
        for decode in self.decodes:
            flags += ["--worker", decode.url]
        return flags


@pytest.fixture(scope="module")
def pair(engines: Engines) -> Iterator[Pair]:
    with engines.group() as started:
        started.append(engines.start(kv_role="kv_producer", name="tiny"))
        started.append(
            engines.start(
                kv_role="kv_consumer", name="tiny", extra_args=["--max-num-seqs", str(WINDOW)]
            )
        )
        yield Pair(started[0], started[1:])


def pd_gateway(gateway: Launcher, pair: Pair, *more: str) -> Any:
    return gateway(*pair.urls(), *more)


async def ready_pd(gw: Any, pair: Pair) -> None:
    for worker in (pair.prefill, *pair.decodes):
        await wait_worker(admin_address(gw), worker.address, is_ready, within_s=WAIT_S)


# -- registration and correctness --------------------------------------------------------


async def test_the_legs_register_with_their_roles_and_a_stream_equals_a_regular_workers(
    engine: EngineWorker, pair: Pair, gateway: Launcher
) -> None:
    gw = pd_gateway(gateway, pair)
    await ready_pd(gw, pair)
    listed = await list_workers(admin_address(gw))
    roles = {worker_id: w.role for worker_id, w in listed.items()}
    assert roles[pair.prefill.address] == 2 and roles[pair.decode.address] == 3  # PREFILL, DECODE
    reference, error = await streamed(engine.address, greedy("ref-a", prompt(200, 1)))
    assert error is None and len(reference) == 24
    through, error = await streamed(gw.address, greedy("pd-a", prompt(200, 1)), "tiny")
    assert error is None
    assert through == reference  # greedy: token for token
    line = logged(gw.log_path, "pd-a")
    assert line["completion_tokens"] == 24  # counted once, the decode's
    assert set(line["legs"]) == {"prefill", "decode"}


async def test_two_concurrent_calls_each_equal_their_own_reference(
    engine: EngineWorker, pair: Pair, gateway: Launcher
) -> None:
    gw = pd_gateway(gateway, pair)
    await ready_pd(gw, pair)
    prompts = {"pd-b": prompt(180, 2), "pd-c": prompt(220, 3)}
    references = {
        rid: (await streamed(engine.address, greedy(f"ref-{rid}", tokens)))[0]
        for rid, tokens in prompts.items()
    }
    results = await asyncio.gather(
        *(streamed(gw.address, greedy(rid, tokens), "tiny") for rid, tokens in prompts.items())
    )
    for (rid, _), (tokens, error) in zip(prompts.items(), results, strict=True):
        assert error is None
        assert tokens == references[rid], rid
    assert references["pd-b"] != references["pd-c"]  # the prompts lead elsewhere


async def test_the_decode_uses_the_kv_the_prefill_sent_not_its_own(pair: Pair) -> None:
    """Prompt C decoded with prompt B's hand-off continues B, not C: the KV came over
    NIXL from the prefill and was not recomputed from C's tokens."""
    b, c = prompt(160, 4), prompt(160, 5)
    async with channel(pair.prefill.address) as pc, channel(pair.decode.address) as dc:
        prefill, decode = vllm_grpc.VllmEngineStub(pc), vllm_grpc.VllmEngineStub(dc)

        async def handed_off(request_id: str, tokens: list[int]) -> str:
            asked = greedy(request_id, tokens, 1)
            asked.stream = False
            asked.kv_transfer_params_json = PREFILL_KV
            params = ""
            async for reply in prefill.Generate(asked, timeout=60):
                if reply.HasField("complete"):
                    params = reply.complete.kv_transfer_params_json
            assert params, "the prefill returned no kv_transfer_params"
            return params

        async def decoded(request_id: str, tokens: list[int], params: str) -> list[int]:
            asked = greedy(request_id, tokens)
            asked.kv_transfer_params_json = params
            got: list[int] = []
            async for reply in decode.Generate(asked, timeout=60):
                if reply.HasField("chunk"):
                    got.extend(reply.chunk.token_ids)
            return got

        own = await decoded("kv-c", c, await handed_off("kv-c", c))
        crossed = await decoded("kv-bc", c, await handed_off("kv-bc", b))
    assert len(own) == len(crossed) == 24
    assert crossed != own


async def test_n_4_runs_a_prefill_per_choice_and_each_choice_is_the_greedy_run(
    engine: EngineWorker, pair: Pair, gateway: Launcher
) -> None:
    """vLLM refuses n > 1 under greedy sampling; through a PD pair the gateway splits the
    call into four single-sample ones, each with its own prefill, merged by index."""
    gw = pd_gateway(gateway, pair)
    await ready_pd(gw, pair)
    wanted, error = await streamed(engine.address, greedy("ref-n4", prompt(100, 11), 12))
    assert error is None and len(wanted) == 12
    req = greedy("pd-n4", prompt(100, 11), 12)
    req.sampling_params.n = 4
    by_choice, error = await choices(gw.address, req, "tiny")
    assert error is None
    assert by_choice == {index: wanted for index in range(4)}
    line = logged(gw.log_path, "pd-n4")
    assert line["code"] == "OK" and line["completion_tokens"] == 4 * 12
    assert len(line["legs"]["prefill"]) == 4 and len(line["legs"]["decode"]) == 4, line


# -- abandonment -----------------------------------------------------------------------


@pytest.mark.parametrize("when", CANCEL_WHEN)
async def test_a_client_cancel_leaves_both_legs_idle(
    when: str, pair: Pair, gateway: Launcher
) -> None:
    gw = pd_gateway(gateway, pair)
    await ready_pd(gw, pair)
    rid = f"pd-cancel-{when.split()[0]}"
    await cancelled(gw.address, greedy(rid, prompt(300, 6), 1500), when)
    await wait_idle(pair.prefill, pair.decode)
    line = logged(gw.log_path, rid)
    assert line["code"] == "CANCELLED"


# -- the decode's window -----------------------------------------------------------------


async def test_a_burst_six_times_the_decode_window_is_served_or_refused_in_time(
    pair: Pair, gateway: Launcher
) -> None:
    gw = pd_gateway(gateway, pair)
    await ready_pd(gw, pair)
    requests = [greedy(f"burst-{i}", prompt(120, 20 + i), 200) for i in range(6 * WINDOW)]
    await burst(gw.address, requests, 200)
    await wait_idle(pair.prefill, pair.decode)
    # The prefill hears the decode's reads at its next step: one more call, then its log.
    _, error = await streamed(gw.address, greedy("after-burst", prompt(50, 8), 4), "tiny")
    assert error is None
    assert invalid_reads(pair.prefill, "burst-") == []


# -- sequential calls: no stall ----------------------------------------------------------


@pytest.mark.xfail(
    strict=False,
    reason="vLLM 0.32.0's NIXL path on the CPU, not the gateway: under load on two cores a "
    "decode's read waits up to the prefill's 30 s lease and the prefill logs 'Potentially "
    "invalid KV blocks for unrecognized request'; stalls up to the lease happen with "
    "the engines alone too (docs/real-engines.md, vLLM prefill/decode over NIXL). "
    "Passed with fewer workers running.",
)
async def test_sequential_pd_calls_do_not_stall_and_no_block_is_read_after_its_lease(
    pair: Pair, gateway: Launcher
) -> None:
    gw = pd_gateway(gateway, pair)
    await ready_pd(gw, pair)
    requests = [greedy(f"seq-{i}", prompt(200, 40 + i)) for i in range(SEQUENTIAL)]
    took = await one_by_one(gw.address, requests, 24)
    _, slow = spread(f"{SEQUENTIAL} sequential PD calls", took)
    _, error = await streamed(gw.address, greedy("after-seq", prompt(50, 9), 4), "tiny")
    assert error is None
    assert invalid_reads(pair.prefill, "seq-") == []
    assert len(slow) <= SEQUENTIAL // 10, "PD calls stall (docs/real-engines.md)"


# disagg.decode_first_message_timeout_s below; a decode's first message normally takes 0.01-2 s
STALL_BOUND_S = 5.0
STALLED = "no first message within 5 s (disagg.decode_first_message_timeout_s)"


async def test_with_a_bound_on_the_decode_s_first_message_no_call_waits_on_a_stall(
    pair: Pair, gateway: Launcher, tmp_path: Path
) -> None:
    """What the gateway does about the engine's stall (above): a decode with no first
    message within the bound is given up before any byte reached the client; with no other
    decode the call is answered UNAVAILABLE at once, which the client may retry, instead
    of waiting up to the prefill's 30 s lease. (A stalled pair stalls its next transfers
    too, and the decode keeps the given-up requests until they start: its window may
    fill, and calls are then refused WORKERS_OVERLOADED. Either way, no client waits.)"""
    config = write_config(tmp_path, {"disagg": {"decode_first_message_timeout_s": STALL_BOUND_S}})
    gw = pd_gateway(gateway, pair, "--config", config)
    await ready_pd(gw, pair)
    took: list[float] = []
    served: list[float] = []
    given_up = refused = 0
    for i in range(SEQUENTIAL):
        began = time.monotonic()
        tokens, error = await streamed(gw.address, greedy(f"bnd-{i}", prompt(200, 90 + i)), "tiny")
        took.append(time.monotonic() - began)
        if error is None:
            assert len(tokens) == 24
            served.append(took[-1])
        elif error.code() is grpc.StatusCode.UNAVAILABLE:
            assert error.details() == f"decode worker {pair.decode.address}: {STALLED}"
            given_up += 1
        else:  # the decode's window full of transfers given up, still running there
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert rich_status(error)[1]["ErrorInfo"].reason == "WORKERS_OVERLOADED"
            refused += 1
    label = f"{SEQUENTIAL} sequential PD calls, decode bound {STALL_BOUND_S:g} s"
    spread(f"{label}, given up {given_up}, refused {refused}", took)
    assert served, "no call served"
    median, _ = spread(f"the {len(served)} served of them", served)
    # no call waits on its decode past the bound; the rest (the prefill, the stream) takes
    # at most three times a served call (refusals take milliseconds: in one run four
    # stalls in a row filled the window and the next 43 calls were refused within a
    # second, which made the median of all 50 calls 7 ms)
    assert max(took) <= STALL_BOUND_S + 3 * median


# -- failure and rejoin ------------------------------------------------------------------


async def test_the_only_decode_down_is_unavailable_at_once_and_rejoins(
    pair: Pair, gateway: Launcher
) -> None:
    gw = pd_gateway(gateway, pair)
    await ready_pd(gw, pair)
    pair.decode.kill()
    try:
        await until_unavailable(gw.address, greedy("down", prompt(50, 7), 4), "decode")
    finally:
        pair.decode.start()
    await wait_worker(admin_address(gw), pair.decode.address, is_ready, within_s=WAIT_S)
    tokens, error = await streamed(gw.address, greedy("back", prompt(50, 7), 4), "tiny")
    assert error is None and len(tokens) == 4
