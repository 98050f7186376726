"""Migration with real processes: a worker SIGKILLed in the middle of a stream, for both
engines, regular and disaggregated, and a rolling restart of every worker of a model
under long streams. The client reads one uninterrupted stream: the simulator's output
continues like a greedy model's, so its tokens must equal an uninterrupted run's, and the
worker that took over logs the continuation's input: the prompt and the tokens relayed.
(The rules, each refusal and the counters: tests/component/test_migration.py.)
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway_sim.client import (
    admin_address,
    channel,
    generate_for,
    model_md,
    stub_for,
    wait_health,
    write_config,
)
from gateway_sim.launch import START_S, Child, start_sim, worker_url
from gateway_sim.model import output_tokens
from tests.support.availability import is_ready, wait_worker
from tests.support.helpers import request_events
from tests.support.launch import Launcher
from tests.support.serial import run_alone

pytestmark = [pytest.mark.sim_processes, pytest.mark.timeout(120)]

PROMPT = [1, 2, 3]  # the helpers' requests' prompt
TOKENS = 200
KILL_AT = 20
INPUT_LINE = re.compile(r"generate (\S+): (\d+) input tokens (\[[0-9, ]*\])")


def logged_sim(processes: list[Child], directory: Path, name: str, *args: str) -> Child:
    """A `gateway sim` process whose log (each call's input included) goes to a file."""
    path = directory / f"{name}.log"
    with open(path, "w") as log:
        child = start_sim(
            "--name", name, "--log-level", "info", *args, stderr=log.fileno(), timeout=START_S
        )
    child.log_path = path
    processes.append(child)
    return child


def inputs(workers: list[Child]) -> dict[str, list[int]]:
    """Every Generate's input the workers logged, by the request id they were given."""
    found: dict[str, list[int]] = {}
    for child in workers:
        for request_id, _, ids in INPUT_LINE.findall(child.log_path.read_text()):
            found[request_id] = [int(i) for i in ids.strip("[]").split(",") if i.strip()]
    return found


def tokens_of(messages: list[Any]) -> list[int]:
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]


def flags(prefill: Child | None, workers: list[Child], runtime: str) -> list[str]:
    args: list[str] = []
    if prefill is not None:
        query = {"model": "m", "runtime": runtime, "role": "prefill"}
        if "bootstrap" in prefill.extra:
            query["bootstrap_port"] = prefill.extra["bootstrap"]
        args += ["--worker", worker_url(prefill, **query)]
    role = {"role": "decode"} if prefill is not None else {}
    for child in workers:
        args += ["--worker", worker_url(child, model="m", runtime=runtime, **role)]
    return args


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
@pytest.mark.parametrize("disaggregated", [False, True], ids=["regular", "pd"])
async def test_a_stream_goes_on_after_its_worker_is_killed(
    runtime: str,
    disaggregated: bool,
    gateway: Launcher,
    processes: list[Child],
    tmp_path: Path,
) -> None:
    common = ("--runtime", runtime, "--model", "m", "--token-ms", "20")
    prefill = None
    if disaggregated:
        prefill = logged_sim(processes, tmp_path, "p", *common, "--role", "prefill")
        role: tuple[str, ...] = ("--role", "decode")
    else:
        role = ()
    workers = [logged_sim(processes, tmp_path, name, *common, *role) for name in ("a", "b")]
    gw = gateway(*flags(prefill, workers, runtime))
    await wait_health(gw.address, "m", runtime)
    async with channel(gw.address) as ch:
        call = stub_for(ch, runtime).Generate(
            generate_for(runtime, "r1", TOKENS), metadata=model_md("m")
        )
        messages: list[Any] = []
        while len(tokens_of(messages)) < KILL_AT:
            messages.append(await call.read())
        serving = dict(await call.initial_metadata())["x-sim-worker"]
        [doomed] = [w for w in workers if w.args[w.args.index("--name") + 1] == serving]
        doomed.kill()  # SIGKILL, KILL_AT tokens into the stream
        while (message := await call.read()) is not grpc.aio.EOF:
            messages.append(message)
        assert await call.code() is grpc.StatusCode.OK
    tokens = tokens_of(messages)
    assert tokens == output_tokens(PROMPT, TOKENS)  # none twice, none lost
    done = messages[-1].complete
    assert (done.prompt_tokens, done.finish_reason) == (len(PROMPT), "length")
    if runtime == "sglang":
        assert done.completion_tokens == TOKENS
        assert [m.chunk.completion_tokens for m in messages[:-1]] == list(range(1, TOKENS + 1))
    # The worker that took over was sent the prompt and exactly what had been relayed.
    logged = inputs([*workers, *([prefill] if prefill else [])])
    resent = logged["r1~1"]
    relayed = len(resent) - len(PROMPT)
    assert relayed >= KILL_AT
    assert resent == PROMPT + output_tokens(PROMPT, relayed)
    [event] = request_events(gw.log_path, "Generate")
    assert (event["code"], event["migrations"], event["completion_tokens"]) == ("OK", 1, TOKENS)


async def test_a_rolling_restart_under_long_streams_is_never_seen_by_clients(
    gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """Each worker in turn is stopped (SIGTERM: its 1 s grace cuts the streams it still
    has) and started again on its port while 50 long streams run; every stream ends OK
    with every token once. A stream may move at each of the three restarts, so this runs
    with max_migrations 3 (the default, 2, covers two)."""
    slow = ("--model", "m", "--token-ms", "20")
    workers = [logged_sim(processes, tmp_path, f"w{i}", *slow) for i in range(3)]
    config = write_config(
        tmp_path,
        {"migration": {"max_migrations": 3}, "probe": {"interval_s": 0.2}},
    )
    gw = gateway("--config", config, *flags(None, workers, "sglang"))
    await wait_health(gw.address, "m")
    run_alone()  # 50 streams and three restarts need the machine
    admin = admin_address(gw)
    async with channel(gw.address) as ch:
        stub = stub_for(ch, "sglang")
        calls = [
            stub.Generate(generate_for("sglang", f"s{i}", 250), metadata=model_md("m"))
            for i in range(50)
        ]
        running = [asyncio.ensure_future(read_all(c)) for c in calls]
        for index, child in enumerate(list(workers)):
            port = child.port
            await asyncio.to_thread(child.stop)  # SIGTERM: its grace ends the streams left
            processes.remove(child)
            workers[index] = logged_sim(
                processes, tmp_path, f"w{index}-again", *slow, "--listen", f"127.0.0.1:{port}"
            )
            await wait_worker(admin, f"127.0.0.1:{port}", is_ready)
        results = await asyncio.gather(*running)
    expected = output_tokens(PROMPT, 250)
    assert [code for code, _ in results] == [grpc.StatusCode.OK] * 50
    assert all(tokens == expected for _, tokens in results)
    events = request_events(gw.log_path, "Generate")
    assert len(events) == 50 and {e["code"] for e in events} == {"OK"}
    assert sum(e["migrations"] for e in events) > 0  # streams did move


async def read_all(call: Any) -> tuple[grpc.StatusCode, list[int]]:
    messages = [m async for m in call]
    return await call.code(), tokens_of(messages)
