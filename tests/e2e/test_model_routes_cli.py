"""`gateway models routes|set-route` against a real `gateway serve`: the split changes
for the next call, and refusals exit with the admin CLI's statuses (3: no such alias, 2:
a route the config's rules refuse, or a malformed MODEL=WEIGHT)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health,
    write_config,
)
from gateway_sim.launch import worker_url
from tests.support.availability import run_cli
from tests.support.helpers import wait_for_events
from tests.support.launch import Launcher

pytestmark = pytest.mark.timeout(120)


async def test_set_route_moves_the_next_calls(
    gateway: Launcher, sim: Launcher, tmp_path: Path
) -> None:
    v2, v3 = sim("--model", "v2"), sim("--model", "v3")
    route = [{"model": "v2", "weight": 100}, {"model": "v3", "weight": 0}]
    config = write_config(tmp_path, {"models": {"chat": {"route": route}}})
    gw = gateway(
        "--config",
        config,
        "--worker",
        worker_url(v2, model="v2", runtime="sglang"),
        "--worker",
        worker_url(v3, model="v3", runtime="sglang"),
    )
    admin = ("--admin", admin_address(gw))
    listed = run_cli("models", "routes", *admin)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split() == ["chat", "v2=100", "v3=0"]

    changed = run_cli("models", "set-route", "chat", "v2=0", "v3=1", *admin)
    assert (changed.returncode, changed.stdout) == (0, "chat -> v2=0 v3=1\n"), changed.stderr
    await wait_health(gw.address, "chat")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(3):
            _, error = await collect(
                stub.Generate(sgl_generate(f"r{i}"), metadata=model_md("chat"))
            )
            assert error is None
    events = wait_for_events(gw.log_path, 3, rpc="Generate")
    assert {(e["model"], e["target"], e["worker"]) for e in events} == {("chat", "v3", v3.address)}

    refused = {
        "no_alias": run_cli("models", "set-route", "v2", "v3=1", *admin),
        "zero": run_cli("models", "set-route", "chat", "v2=0", "v3=0", *admin),
        "malformed": run_cli("models", "set-route", "chat", "v2", *admin),
    }
    statuses = {case: result.returncode for case, result in refused.items()}
    assert statuses == {"no_alias": 3, "zero": 2, "malformed": 2}, {
        case: result.stderr for case, result in refused.items()
    }
    assert refused["no_alias"].stderr.startswith("gateway: NOT_FOUND: 'v2' is no alias")
    assert "INVALID_ARGUMENT: route of 'chat': needs a weight above 0" in refused["zero"].stderr
    still = run_cli("models", "routes", *admin, "--json")
    assert '"weight": 1' in still.stdout
