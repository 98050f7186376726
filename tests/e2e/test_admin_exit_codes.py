"""Every exit status of the admin CLI (`gateway workers`, `gateway queues`), each from the
case that causes it against a real `gateway serve`: a script tells "no such worker" from
"already there" from "gateway down" from "bad token" by the status alone. (The mapping
and its table: tests/unit/admin/test_exit_statuses.py.)"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from gateway_sim.client import admin_address, closed_port, write_config
from gateway_sim.launch import worker_url
from tests.support.availability import run_cli
from tests.support.launch import Launcher

TOKEN = "s3cret"


def run_all(cases: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each case's `gateway ARGS`, side by side (each is a Python start-up)."""
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        done = dict(zip(cases, pool.map(lambda argv: run_cli(*argv), cases.values()), strict=True))
    return done


def test_each_kind_of_failure_has_its_own_exit_status(
    gateway: Launcher, sim: Launcher, tmp_path: Path
) -> None:
    worker = sim("--model", "m")
    url = worker_url(worker, model="m", runtime="sglang")
    listed = tmp_path / "workers.yaml"
    listed.write_text(yaml.safe_dump([url]))
    config = write_config(tmp_path, {"discovery": [{"source": "file", "path": str(listed)}]})
    gw = gateway("--config", config, "--admin-token", TOKEN)
    admin = admin_address(gw)
    nobody = closed_port()
    down = f"127.0.0.1:{nobody.getsockname()[1]}"

    def workers(verb: str, *args: str, at: str = admin, token: str = TOKEN) -> list[str]:
        return ["workers", verb, "--admin", at, *(("--token", token) if token else ()), *args]

    results = run_all(
        {
            "ok": workers("list"),
            "usage": ["workers", "frobnicate"],
            "invalid": workers("add", "http://127.0.0.1:1"),
            "not_found": workers("remove", "127.0.0.1:1"),
            "exists": workers("add", url),
            "unreachable": workers("list", at=down),
            "queues_unreachable": ["queues", "--admin", down],
            "no_token": workers("list", token=""),
            "wrong_token": workers("list", token="nope"),
            "discovered": workers("remove", worker.address),
        }
    )
    nobody.close()
    statuses = {case: result.returncode for case, result in results.items()}
    assert statuses == {
        "ok": 0,
        "usage": 2,
        "invalid": 2,
        "not_found": 3,
        "exists": 4,
        "unreachable": 5,
        "queues_unreachable": 5,
        "no_token": 6,
        "wrong_token": 6,
        "discovered": 7,
    }, {case: result.stderr for case, result in results.items()}
    assert worker.address in results["ok"].stdout
    errors = {case: result.stderr for case, result in results.items() if case != "ok"}
    assert errors["usage"].splitlines()[-1].startswith("gateway workers: error: argument VERB")
    assert errors["invalid"] == (
        "gateway: INVALID_ARGUMENT: worker 'http://127.0.0.1:1': scheme must be grpc:// or "
        "grpcs://\n"
    )
    assert errors["not_found"] == "gateway: NOT_FOUND: no worker '127.0.0.1:1' is registered\n"
    assert errors["exists"] == (
        f"gateway: ALREADY_EXISTS: worker {worker.address} is already registered\n"
    )
    for case in ("unreachable", "queues_unreachable"):
        assert errors[case].startswith("gateway: UNAVAILABLE: "), errors[case]
    assert errors["no_token"].startswith("gateway: UNAUTHENTICATED: ")
    assert errors["wrong_token"] == "gateway: UNAUTHENTICATED: the admin token was not accepted\n"
    assert errors["discovered"].startswith(
        f"gateway: FAILED_PRECONDITION: worker {worker.address} is listed by file:"
    )
    for case, text in errors.items():
        assert results[case].stdout == "", case
        assert "Traceback" not in text, case
