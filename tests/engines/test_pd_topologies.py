"""Both engines' prefill/decode with two workers on each leg (2p2d) on real engines: vLLM
over NIXL in host memory, SGLang over Mooncake on TCP. The part of the PD catalogue that
needs a second worker on a leg:

- every prefill and every decode takes traffic under round robin, and the same prompt
  through two different pairs gives the same greedy run;
- a stream whose decode is killed goes on on the other decode (migration: the prefill
  again, with the tokens so far) and equals the uninterrupted greedy run;
- a leg that loses one of its two workers keeps serving with no client error (a failure
  before the first byte is retried on another pair), and the worker, started again on its
  address, rejoins and takes traffic;
- `predicted_latency` learns both legs from the calls' own times (the prefill's time to
  first token, the decode's pace) and refuses a sheddable call no worker of a leg is
  predicted to serve in time.

The module is run once per engine; its four workers are the tier's four, so the session's
shared workers are stopped first (the next test that asks for one starts it again). The
reference of each comparison is the same gateway's own run: a PD stream equals a regular
worker's in the 1p1d modules (test_pd_vllm.py, test_sglang_pd.py)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.upstream.latency import MIN_SEEN
from gateway_sim.client import admin_address, channel, list_workers, model_md, write_config
from scripts.engines.worker import EngineWorker
from tests.engines.conftest import Engines
from tests.support.availability import is_ready, wait_worker
from tests.support.engines import (
    VOCAB,
    WAIT_S,
    engine_stub,
    greedy,
    logged,
    prediction_errors,
    prompt,
    sglang_greedy,
    streamed,
)
from tests.support.helpers import rich_status
from tests.support.launch import Launcher

LEGS = ("prefill", "decode")
# SGLang 0.5.23's decode keeps what it cached of a prefill that comes back on its address:
# now and then every hand-off with it then waits on both legs (test_sglang_pd.py has the
# evidence). The bound answers such a call UNAVAILABLE, or places it again elsewhere.
SGLANG_BOUND_S = 10.0
# predicted_latency's warm-up: at least WARM_CALLS, then on until every worker of both
# legs has MIN_SEEN lessons (cold placements can fall unevenly), at most MAX_WARM_CALLS.
WARM_CALLS = 28
MAX_WARM_CALLS = 80


@dataclass(frozen=True)
class Engine:
    """What differs between the engines here: how a leg's worker starts, a greedy
    request, and the gateway's settings beyond the model's vocabulary."""

    start: Callable[[Engines, str], EngineWorker]
    request: Callable[[str, Sequence[int], int], Any]
    settings: dict[str, Any] = field(default_factory=dict)


ENGINES = {
    "vllm": Engine(
        start=lambda engines, leg: engines.start(
            kv_role="kv_producer" if leg == "prefill" else "kv_consumer", name="tiny"
        ),
        request=greedy,
    ),
    "sglang": Engine(
        start=lambda engines, leg: engines.start("sglang", name="tiny", disaggregation=leg),
        request=sglang_greedy,
        settings={"disagg": {"decode_first_message_timeout_s": SGLANG_BOUND_S}},
    ),
}


@dataclass
class TwoByTwo:
    name: str
    engine: Engine
    legs: dict[str, list[EngineWorker]]

    @property
    def workers(self) -> list[EngineWorker]:
        return [worker for leg in LEGS for worker in self.legs[leg]]

    def request(self, request_id: str, tokens: Sequence[int], max_new: int = 8) -> Any:
        return self.engine.request(request_id, tokens, max_new)


@pytest.fixture(scope="module", params=list(ENGINES))
def two_by_two(request: pytest.FixtureRequest, engines: Engines) -> Iterator[TwoByTwo]:
    for worker in engines.workers:
        if worker.running:
            worker.stop()  # the tier's four are this module's
    engine = ENGINES[request.param]
    with engines.group() as started:
        legs: dict[str, list[EngineWorker]] = {leg: [] for leg in LEGS}
        for leg in LEGS:
            for _ in range(2):
                legs[leg].append(engine.start(engines, leg))
                started.append(legs[leg][-1])
        yield TwoByTwo(request.param, engine, legs)


async def gateway_on(gateway: Launcher, tmp_path: Path, fleet: TwoByTwo, **more: Any) -> Any:
    """A gateway told the four addresses (it finds each one's role itself), every one
    ready; `more`: settings beside the engine's."""
    settings = {"models": {"tiny": {"vocab_size": VOCAB}}, **fleet.engine.settings, **more}
    flags = ["--config", write_config(tmp_path, settings)]
    for worker in fleet.workers:
        flags += ["--worker", worker.url]
    gw = gateway(*flags)
    await ready(gw, *fleet.workers)
    return gw


async def ready(gw: Any, *workers: EngineWorker) -> None:
    for worker in workers:
        await wait_worker(admin_address(gw), worker.address, is_ready, within_s=WAIT_S)


def served_by(gw: Any, request_id: str) -> dict[str, str]:
    """The worker of each leg that served the call (the last one it called)."""
    return {leg: workers[-1] for leg, workers in logged(gw.log_path, request_id)["legs"].items()}


async def test_every_prefill_and_every_decode_takes_traffic_and_pairs_agree(
    two_by_two: TwoByTwo, gateway: Launcher, tmp_path: Path
) -> None:
    gw = await gateway_on(gateway, tmp_path, two_by_two)
    runs: list[list[int]] = []
    for i in range(4):  # round robin on each leg: consecutive calls meet other pairs
        req = two_by_two.request(f"rr-{i}", prompt(100, 3), 16)
        tokens, error = await streamed(gw.address, req, "tiny")
        assert error is None and len(tokens) == 16, error
        runs.append(tokens)
    assert all(run == runs[0] for run in runs)  # every pair gives the same greedy run
    pairs = [served_by(gw, f"rr-{i}") for i in range(4)]
    print(f"\n[{two_by_two.name} 2p2d round robin] pairs: {pairs}")
    for leg in LEGS:
        assert {pair[leg] for pair in pairs} == {w.address for w in two_by_two.legs[leg]}


async def test_a_stream_whose_decode_dies_goes_on_on_the_other_and_equals_the_greedy_run(
    two_by_two: TwoByTwo, gateway: Launcher, tmp_path: Path
) -> None:
    gw = await gateway_on(gateway, tmp_path, two_by_two)
    wanted = 400
    reference, error = await streamed(
        gw.address, two_by_two.request("mig-ref", prompt(64, 9), wanted), "tiny"
    )
    assert error is None and len(reference) == wanted, error
    decodes = two_by_two.legs["decode"]
    got: list[int] = []
    killed: EngineWorker | None = None
    req = two_by_two.request("mig", prompt(64, 9), wanted)
    try:
        async with channel(gw.address) as ch:
            call = engine_stub(ch, req).Generate(req, metadata=model_md("tiny"), timeout=300)
            async for reply in call:
                if reply.HasField("chunk"):
                    got.extend(reply.chunk.token_ids)
                if killed is None and len(got) >= 40:
                    listed = await list_workers(admin_address(gw))
                    busy = [d for d in decodes if listed[d.address].inflight > 0]
                    assert len(busy) == 1, "the stream's decode is not known"
                    killed = busy[0]
                    killed.kill()
        assert killed is not None
        assert got == reference  # every token once, in order, as if nothing happened
        line = logged(gw.log_path, "mig")
        assert line["code"] == "OK" and line["migrations"], line
    finally:
        if killed is not None:
            killed.start()


@pytest.mark.parametrize("leg", ["decode", "prefill"])
async def test_a_leg_that_loses_one_of_two_costs_no_call_and_the_worker_rejoins(
    leg: str, two_by_two: TwoByTwo, gateway: Launcher, tmp_path: Path
) -> None:
    gw = await gateway_on(gateway, tmp_path, two_by_two)
    down = two_by_two.legs[leg][1]
    down.kill()
    try:
        for i in range(6):
            req = two_by_two.request(f"{leg}-down-{i}", prompt(100, 10 + i))
            tokens, error = await streamed(gw.address, req, "tiny")
            assert error is None and len(tokens) == 8, error
    finally:
        down.start()
    await ready(gw, down)
    await rejoined(gw, two_by_two, leg, down)


async def rejoined(gw: Any, fleet: TwoByTwo, leg: str, back: EngineWorker) -> None:
    """Calls until one is served with `back` on its leg (round robin reaches it within
    two); every call served. The one exception is SGLang's prefill back on its address
    (SGLANG_BOUND_S): such a call may be answered UNAVAILABLE at the bound, never at the
    client's deadline; the decodes are then restarted, as an operator would, and the
    prefill must serve."""
    stranded = 0
    for i in range(8):
        began = time.monotonic()
        req = fleet.request(f"back-{i}", prompt(50, i))
        tokens, error = await streamed(gw.address, req, "tiny")
        took = time.monotonic() - began
        if error is None:
            assert len(tokens) == 8
            if served_by(gw, f"back-{i}")[leg] == back.address:
                break
            continue
        assert (fleet.name, leg) == ("sglang", "prefill"), error.details()
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()
        assert took < 3 * SGLANG_BOUND_S  # the bound, not the client's deadline (120 s)
        stranded += 1
        for decode in fleet.legs["decode"]:
            decode.kill()
            decode.start()
        await ready(gw, *fleet.legs["decode"])
    else:
        raise AssertionError(f"{back.address} took no call after it came back")
    print(f"\n[{fleet.name} {leg} back on its address] {stranded} calls stranded")


async def test_predicted_latency_learns_both_legs_and_sheds_what_neither_can_meet(
    two_by_two: TwoByTwo, gateway: Launcher, tmp_path: Path
) -> None:
    """`predicted_latency` on a PD model: the prefill leg placed by predicted time to
    first token, the decode leg by predicted time per output token, each learned from the
    calls' own times on real engines. Once every worker's models are warm, the prefill
    leg's predictions reach the log, and a sheddable call asking a time to first token,
    or a pace, that no worker of that leg is predicted to meet is refused
    SLO_UNATTAINABLE (a cold model would place it: shedding needs every candidate's
    prediction, `every`)."""
    gw = await gateway_on(gateway, tmp_path, two_by_two, default_policy="predicted_latency")
    # Cold models place as cache_aware (prefill) and least in flight (decode). Every call
    # that ends OK, unretried, teaches its prefill worker's model and its decode worker's
    # (`lessons`), so the log counts them: warm-up waits until each worker has MIN_SEEN.
    lines: list[dict[str, Any]] = []
    taught: Counter[str] = Counter()
    everyone = [w.address for leg in LEGS for w in two_by_two.legs[leg]]
    for i in range(MAX_WARM_CALLS):
        tokens_in = prompt(48 + 40 * (i % 6), 100 + i)
        tokens, error = await streamed(gw.address, two_by_two.request(f"pl-{i}", tokens_in), "tiny")
        assert error is None and len(tokens) == 8, error
        lines.append(line := logged(gw.log_path, f"pl-{i}"))
        assert line["code"] == "OK", line
        if not line["retries"] and not line["migrations"] and line["messages"] >= 2:
            taught.update(line["legs"][leg][-1] for leg in LEGS)
        if i + 1 >= WARM_CALLS and min(taught[w] for w in everyone) >= MIN_SEEN:
            break
    else:
        raise AssertionError(f"not every worker warmed in {MAX_WARM_CALLS} calls: {taught}")
    late = [line for line in lines[-8:] if line["predicted_first_message_ms"] is not None]
    assert late, "the prefill leg's models never warmed"
    errors = sorted(prediction_errors(late))
    shed = {}
    for header in ("x-slo-ttft-ms", "x-slo-tpot-ms"):
        shed[header] = 0
        for i in range(3):  # on every turn: shedding comes before exploring
            req = two_by_two.request(f"{header}-{i}", prompt(64, 200 + i))
            asked = ((header, "0.01"), ("x-priority", "batch"))
            _, error = await streamed(gw.address, req, "tiny", asked)
            if error is not None:
                assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
                _, details = rich_status(error)
                assert details["ErrorInfo"].reason == "SLO_UNATTAINABLE"
                shed[header] += 1
        assert shed[header] == 3, (header, shed)
    observed = sorted(line["first_message_ms"] for line in late)
    print(
        f"\n[{two_by_two.name} 2p2d predicted_latency] {len(lines)} warm-up calls; prefill "
        f"predictions in the last 8 "
        f"calls: {len(late)}, error median {errors[len(errors) // 2]:.0%} (first message "
        f"{observed[0]:.0f}-{observed[-1]:.0f} ms, median {observed[len(observed) // 2]:.0f}); "
        f"shed {shed}"
    )
