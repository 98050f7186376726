"""Deadlines around the supervisor of `--processes N`, with fake processes (no process is
started): its liveness check kills a process that stops answering (once, after its misses,
and only that one), the metrics scrape leaves out a process that does not answer in time,
and the private directory is removed by whoever is last. Short deadlines keep these fast."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from gateway.admin.v1 import admin_pb2 as pb
from gateway.config import build_config
from gateway.scale.child import Orphan, share_directory, tidy
from gateway.scale.merge import ProcessesCollector
from gateway.scale.process import Position
from gateway.scale.supervisor import Supervisor
from tests.support.control_plane import LATE_S, FakeAdmin

# ------------------------------------------------------------------ liveness


@dataclass
class FakeChild:
    """A running serving process as the supervisor holds it."""

    pid: int = 4242
    returncode: int | None = None
    killed: int = 0

    def kill(self) -> None:
        self.killed += 1


def supervisor(interval_s: float = 0.05, timeout_s: float = 0.05, misses: int = 2) -> Supervisor:
    sup = Supervisor(build_config({"processes": 2}))
    sup.liveness_interval_s, sup.liveness_timeout_s = interval_s, timeout_s
    sup.liveness_misses = misses
    return sup


async def watch_for(
    sup: Supervisor, position: Position, seconds: float, until: Callable[[], bool] = lambda: True
) -> None:
    """Run the position's liveness check for `seconds` (at most 5 s if `until` says when)."""
    task = asyncio.ensure_future(sup._watch(position))
    deadline = time.monotonic() + 5.0
    while not until():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(seconds)
    sup.stopping = True
    await asyncio.wait_for(task, 1.0)


async def test_a_process_that_stops_answering_is_killed_once_after_its_misses() -> None:
    sup = supervisor()
    child, admin = FakeChild(), FakeAdmin(wedged=True)
    position = sup.positions[1]
    position.process, position.admin = child, admin  # type: ignore[assignment]
    with capture_logs() as logs:  # then 0.3 s more: nothing else happens
        await watch_for(sup, position, 0.3, until=lambda: child.killed > 0)
    assert child.killed == 1  # then the keeper restarts it; until then it is not asked
    assert position.admin is None
    unresponsive = [e for e in logs if e["event"] == "serving_process_unresponsive"]
    assert unresponsive == [
        {
            "event": "serving_process_unresponsive",
            "log_level": "error",
            "serving_process": "1",
            "pid": 4242,
            "reason": "no answer to 2 checks of 0.05 s",
        }
    ]
    assert [name for name, _ in admin.calls] == ["list", "list"]


async def test_one_late_answer_is_not_a_kill() -> None:
    """A miss, an answer, a miss, ...: the misses must come in a row."""
    sup = supervisor(interval_s=0.05, timeout_s=0.05)
    child, admin = FakeChild(), ScriptedAdmin(script=[True, False] * 4)
    position = sup.positions[0]
    position.process, position.admin = child, admin  # type: ignore[assignment]
    task = asyncio.ensure_future(sup._watch(position))
    deadline = time.monotonic() + 5.0
    while admin.script:  # until every scripted check ran
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    sup.stopping = True
    await asyncio.wait_for(task, 1.0)
    assert child.killed == 0 and position.admin is admin


@dataclass
class ScriptedAdmin(FakeAdmin):
    """Each ListWorkers takes the next entry: True hangs (a miss), False answers."""

    script: list[bool] = field(default_factory=list)

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, **kw: Any
    ) -> pb.ListWorkersResponse:
        self.wedged = self.script.pop(0) if self.script else False
        return await super().ListWorkers(request, **kw)


async def test_a_process_still_starting_or_a_stopping_gateway_is_not_checked() -> None:
    sup = supervisor()
    child = FakeChild()
    position = sup.positions[0]
    position.process = child  # type: ignore[assignment]  # started, not listening: no admin yet
    await watch_for(sup, position, 0.2)
    assert child.killed == 0
    sup = supervisor()
    sup.stopping = True  # draining: processes close their control sockets on the way out
    position = sup.positions[0]
    position.process, position.admin = child, FakeAdmin(wedged=True)  # type: ignore[assignment]
    await watch_for(sup, position, 0.2)
    assert child.killed == 0


def test_only_the_process_that_did_not_answer_is_replaced() -> None:
    sup = supervisor()
    position = sup.positions[0]
    old, new, child = FakeAdmin(), FakeAdmin(), FakeChild()
    position.process, position.admin = child, new  # type: ignore[assignment]
    sup.replace(old, "AddWorker: no answer within 8 s")
    assert child.killed == 0 and position.admin is new
    sup.replace(new, "AddWorker: no answer within 8 s")
    assert child.killed == 1 and position.admin is None


# ------------------------------------------------------------------ metrics scrape


def test_a_scrape_leaves_out_a_process_that_does_not_answer_within_its_deadline(
    strict: bool,
) -> None:
    """All asked at once: three silent processes cost one deadline, not three (the
    quicker of two scrapes under twice the quicker of two of one: one after the other
    would be three times, and a busy machine only ever adds; within the deadline and
    LATE_S in the timing tier)."""

    def scrape(path: Path, count: int) -> tuple[float, list[Any]]:
        collector = ProcessesCollector(lambda: [f"unix:{path}"] * count, [], timeout_s=0.3)
        started = time.monotonic()
        families = list(collector.collect())
        return time.monotonic() - started, families

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "p0.sock"
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listens, never speaks
        silent.bind(str(path))
        silent.listen()
        try:
            one_s = min(scrape(path, 1)[0] for _ in range(2))
            (elapsed, families), (again, _) = scrape(path, 3), scrape(path, 3)
        finally:
            silent.close()
    assert elapsed >= 0.3 and min(elapsed, again) < 2 * one_s
    if strict:
        assert elapsed < 0.3 + LATE_S
    serving = next(f for f in families if f.name == "gateway_serving_processes")
    assert serving.samples[0].value == 0.0


# ------------------------------------------------------------------ the private directory


def test_the_last_serving_process_to_leave_an_orphaned_directory_removes_it() -> None:
    directory = tempfile.mkdtemp(prefix="gateway-test-")
    (Path(directory) / "p0.launch").write_bytes(b"x")
    (Path(directory) / "p1.launch").write_bytes(b"x")
    first, second = share_directory(directory), share_directory(directory)
    orphaned = True  # the supervisor died
    tidy(directory, first, orphaned)
    assert os.path.isdir(directory)  # the second still holds its share
    tidy(directory, second, orphaned)
    assert not os.path.exists(directory)


def test_a_living_supervisor_removes_its_directory_itself() -> None:
    directory = tempfile.mkdtemp(prefix="gateway-test-")
    try:
        tidy(directory, share_directory(directory), orphaned=False)
        assert os.path.isdir(directory)
        assert share_directory(directory + "-missing") is None
    finally:
        os.rmdir(directory)


def test_a_serving_process_is_an_orphan_once_told_or_adopted() -> None:
    orphan = Orphan(os.getppid())
    assert not orphan
    orphan.told = True  # the death signal came: the pid may still be the dying parent's
    assert orphan
    assert Orphan(-1)  # adopted by someone else
