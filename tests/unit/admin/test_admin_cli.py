"""The `gateway workers` verbs against an in-process admin server (tests/support/admin_server.py):
every verb, the token from a flag or the environment, an unreachable admin port, and the
table they print."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import structlog

from gateway.admin.client import add_workers_arguments, run_workers
from gateway.admin.text import format_table
from gateway.admin.v1 import admin_pb2 as pb
from gateway.upstream.worker import WorkerStatus
from gateway_sim.client import free_port
from tests.support import admin_server
from tests.support.admin_server import TOKEN, Admin, start, stop
from tests.support.waits import until

admin = admin_server.admin  # the fixture (tests/support/admin_server.py)


# --- the `gateway workers ...` verbs ------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gateway workers")
    add_workers_arguments(parser)
    return parser.parse_args(list(argv))


async def cli(*argv: str) -> int:
    """run_workers runs its own event loop: call it from a thread, as the CLI would.

    The in-process fleet's log lines are captured apart, so stdout holds only the CLI's."""
    with structlog.testing.capture_logs():
        return await asyncio.to_thread(run_workers, parse(*argv))


async def test_cli_verbs(admin: Admin, capsys: pytest.CaptureFixture[str]) -> None:
    at = ("--admin", admin.address)
    assert await cli("list", *at) == 0
    assert capsys.readouterr().out == "no workers registered\n"

    worker_id = f"127.0.0.1:{free_port()}"
    assert await cli("add", f"grpc://{worker_id}?model=m&runtime=sglang", *at) == 0
    out = capsys.readouterr().out
    assert out == f"added {worker_id} (model m, runtime sglang, role regular): pending\n"

    # Nothing listens there: its first probe fails and it settles not_ready. Wait for that,
    # so both listings below see one status (listing while it moves raced: CI saw it move).
    worker = admin.fleet.registry.get(worker_id)
    assert worker is not None
    await until(lambda: worker.status is WorkerStatus.NOT_READY, what="first probe failed")
    capsys.readouterr()  # the fleet's own log line of it

    assert await cli("list", *at) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:8] == [
        "WORKER", "MODEL", "RUNTIME", "ROLE", "SOURCE", "STATUS", "INFLIGHT", "OUTLIER"
    ]  # fmt: skip
    assert row.split()[:8] == [
        worker_id, "m", "sglang", "regular", "admin", "not_ready", "0", "closed"
    ]  # fmt: skip

    assert await cli("list", "--json", *at) == 0
    (line,) = capsys.readouterr().out.splitlines()
    listed = json.loads(line)
    assert (listed["id"], listed["status"]) == (worker_id, "WORKER_STATUS_NOT_READY")
    assert listed["inflight"] == 0  # zero values are printed, not left out

    assert await cli("watch", "--count", "1", *at) == 0
    out = capsys.readouterr().out
    assert f"snapshot {worker_id} m sglang regular" in out

    assert await cli("drain", worker_id, *at) == 0
    assert capsys.readouterr().out == f"draining {worker_id} (idle)\n"

    assert await cli("remove", worker_id, "--drain-timeout", "1", *at) == 0
    assert capsys.readouterr().out == f"removed {worker_id} (drained)\n"

    assert await cli("remove", worker_id, *at) == 3  # NOT_FOUND
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"gateway: NOT_FOUND: no worker '{worker_id}' is registered\n"

    assert await cli("add", "grpc://nohost", *at) == 2  # INVALID_ARGUMENT
    assert capsys.readouterr().err.startswith("gateway: INVALID_ARGUMENT: worker 'grpc://nohost'")


async def test_cli_token_from_flag_or_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = await start(token=TOKEN)
    try:
        at = ("--admin", admin.address)
        monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
        assert await cli("list", *at) == 6
        assert capsys.readouterr().err.startswith("gateway: UNAUTHENTICATED: ")
        assert await cli("list", "--token", TOKEN, *at) == 0
        monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
        assert await cli("list", *at) == 0
        assert capsys.readouterr().out == "no workers registered\n" * 2
    finally:
        await stop(admin)


async def test_cli_unreachable_admin_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert await cli("list", "--admin", f"127.0.0.1:{free_port()}") == 5
    assert capsys.readouterr().err.startswith("gateway: UNAVAILABLE: ")


def test_table_shows_load_probe_and_errors() -> None:
    worker = pb.Worker(
        id="h:1",
        model="m",
        runtime="vllm",
        role=pb.ROLE_DECODE,
        status=pb.WORKER_STATUS_READY,
        status_cause="probe: grpc.health SERVING",
        inflight=2,
        breaker_state=pb.BREAKER_STATE_HALF_OPEN,
        load_error="UNAVAILABLE: gone",
        sources=["dns:w.llm", "static"],
    )
    worker.load.running, worker.load.waiting, worker.load.token_usage = 5, 1, 0.42
    worker.last_probe.kind = pb.PROBE_KIND_SERVING
    worker.last_probe.time.FromSeconds(100)
    _, row = format_table([worker], now=102.5).splitlines()
    assert row.split("  ")[0] == "h:1"
    assert row.split() == [
        "h:1", "m", "vllm", "decode", "dns:w.llm,static", "ready", "2", "half_open", "5", "1",
        "42%", "-", "serving", "2.5s", "ago", "probe:", "grpc.health", "SERVING;", "load:",
        "UNAVAILABLE:", "gone",
    ]  # fmt: skip


def test_table_shows_a_worker_not_yet_identified_with_what_its_url_leaves_open() -> None:
    worker = pb.Worker(
        id="h:1",
        model="m",
        status=pb.WORKER_STATUS_UNIDENTIFIED,
        status_cause="health check failed: UNAVAILABLE: refused",
        sources=["static"],
    )
    _, row = format_table([worker], now=0).splitlines()
    assert row.split()[:7] == ["h:1", "m", "?", "?", "static", "unidentified", "0"]
    assert row.endswith("health check failed: UNAVAILABLE: refused")
