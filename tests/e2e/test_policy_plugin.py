"""A policy plugin, installed the way a user installs one (a distribution declaring an
entry point in `grpc_model_gateway.policies`), used by name in a real `gateway serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gateway_sim.client import (
    admin_address,
    channel,
    model_md,
    sgl_generate,
    sgl_grpc,
    write_config,
)
from gateway_sim.launch import SERVE_ARGS, START_S, Child, start, start_many, worker_url
from tests.support.availability import is_ready, wait_worker
from tests.support.helpers import wait_for_events
from tests.support.launch import Launcher
from tests.support.policy_plugin import LAST_ID, write_plugin

CALLS = 6


def with_path(directory: Path) -> dict[str, str]:
    """This environment with `directory` first on the gateway's PYTHONPATH."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(directory) + (os.pathsep + path if path else "")}


def serve(processes: list[Child], log_path: Path, env: dict[str, str], *args: str) -> Child:
    """`gateway serve` as the `gateway` fixture starts it, in the given environment."""
    with open(log_path, "w") as log_file:
        child = start([*SERVE_ARGS, *args], stderr=log_file.fileno(), env=env, timeout=START_S)
    processes.append(child)
    return child


async def test_a_plugin_policy_places_the_calls_of_the_model_that_names_it(
    sim: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    write_plugin(
        plugin, "last-id-policy", {"last_id": "last_id_policy:LastId"}, {"last_id_policy": LAST_ID}
    )
    workers = start_many(sim, *[("--runtime", "sglang", "--model", "m")] * 3)
    config = write_config(tmp_path, {"models": {"m": {"policy": "last_id"}}})
    urls = [arg for w in workers for arg in ("--worker", worker_url(w))]
    log_path = tmp_path / "gateway.log"
    gw = serve(processes, log_path, with_path(plugin), "--config", config, *urls)
    for worker in workers:
        await wait_worker(admin_address(gw), worker.address, is_ready)
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(CALLS):
            request = sgl_generate(request_id=f"p{i}", tokens=1)
            [_ async for _ in stub.Generate(request, metadata=model_md("m"))]
    events = wait_for_events(log_path, CALLS, rpc="Generate")
    # Round robin (the default) would spread six calls over three idle workers; the
    # plugin sends every one to the worker whose id sorts last.
    last = max(w.address for w in workers)
    assert [e["worker"] for e in events] == [last] * CALLS


def test_a_broken_plugin_stops_start_up_with_one_line(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    write_plugin(
        plugin,
        "broken-policy",
        {"broken": "broken_policy:Broken"},
        {"broken_policy": "raise RuntimeError('no GPU here')\n"},
    )
    config = write_config(tmp_path, {"default_policy": "broken"})
    result = subprocess.run(
        [sys.executable, "-m", "gateway", *SERVE_ARGS, "--config", config],
        capture_output=True,
        text=True,
        timeout=START_S,
        env={**os.environ, **with_path(plugin)},
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert json.loads(lines[0])["event"] == (
        "config error: default_policy: policy 'broken' (broken_policy:Broken from"
        " broken-policy) cannot be loaded: RuntimeError: no GPU here"
    ), lines[0]
