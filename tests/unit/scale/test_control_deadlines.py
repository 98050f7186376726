"""Deadlines in the control plane of `--processes N`, with fake processes (no process is
started): a process that does not answer is left out of reads and replaced after a
change; the supervisor's liveness check kills a process that stops answering; the
metrics scrape and the private directory's clean-up. Short deadlines keep these fast."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway.admin.v1 import admin_pb2 as pb
from gateway.config import build_config
from gateway.scale.child import Orphan, share_directory, tidy
from gateway.scale.control import ControlPlane, DesiredFleet, NoAnswer, reconcile, within
from gateway.scale.merge import ProcessesCollector
from gateway.scale.process import Position
from gateway.scale.supervisor import Supervisor
from tests.support.fakes.context import Aborted, FakeContext

READ_S = 0.2  # the read deadline in these tests
SLACK_S = 0.2  # a change's deadline on top of the wait it asks for
LATE_S = 0.4  # how late a timer may fire on an idle machine (the timing tier's bounds)
URL = "grpc://127.0.0.1:7001?model=m&runtime=sglang"
ADDED = "127.0.0.1:7001"


def rpc_error(code: grpc.StatusCode, details: str = "") -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details)


def worker(wid: str, inflight: int = 0) -> pb.Worker:
    return pb.Worker(id=wid, model="m", inflight=inflight, status=pb.WORKER_STATUS_READY)


@dataclass
class FakeAdmin:
    """One serving process's admin API. `wedged`: every call waits forever (a SIGSTOPped
    process); `delay_s`: every call answers after that long; `refuse_add`: AddWorker
    fails with it; `journal` (shared by several) records each call's "asked" and a wedged
    call's "expired" (its deadline cancelled it), in order."""

    workers: dict[str, pb.Worker] = field(default_factory=dict)
    wedged: bool = False
    delay_s: float = 0.0
    refuse_add: aio.AioRpcError | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    events: list[pb.WatchWorkersResponse] = field(default_factory=list)
    journal: list[str] = field(default_factory=list)

    async def _enter(self, name: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((name, kwargs))
        self.journal.append("asked")
        if self.wedged:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.journal.append("expired")
                raise
        await asyncio.sleep(self.delay_s)

    async def AddWorker(self, request: pb.AddWorkerRequest, **kw: Any) -> pb.AddWorkerResponse:
        await self._enter("add", kw)
        if self.refuse_add is not None:
            raise self.refuse_add
        wid = request.url.removeprefix("grpc://").partition("?")[0]
        self.workers[wid] = worker(wid)
        return pb.AddWorkerResponse(worker=self.workers[wid])

    async def RemoveWorker(
        self, request: pb.RemoveWorkerRequest, **kw: Any
    ) -> pb.RemoveWorkerResponse:
        await self._enter("remove", kw)
        gone = self.workers.pop(request.worker_id, None) or worker(request.worker_id)
        return pb.RemoveWorkerResponse(worker=gone, drained=True)

    async def DrainWorker(
        self, request: pb.DrainWorkerRequest, **kw: Any
    ) -> pb.DrainWorkerResponse:
        await self._enter("drain", kw)
        seen = self.workers[request.worker_id]
        seen.status = pb.WORKER_STATUS_DRAINING
        return pb.DrainWorkerResponse(worker=seen, drained=seen.inflight == 0)

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, **kw: Any
    ) -> pb.ListWorkersResponse:
        await self._enter("list", kw)
        return pb.ListWorkersResponse(workers=list(self.workers.values()))

    def WatchWorkers(self, request: pb.WatchWorkersRequest) -> FakeWatch:
        return FakeWatch(self.events)


@dataclass
class FakeWatch:
    events: list[pb.WatchWorkersResponse]
    cancelled: bool = False

    async def __aiter__(self) -> AsyncIterator[pb.WatchWorkersResponse]:
        for event in self.events:
            yield event

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeProcess:
    admin: FakeAdmin | None
    running: bool = True


@dataclass
class Replacer:
    """The supervisor's side: records each replacement and leaves that process out."""

    processes: list[FakeProcess]
    replaced: list[tuple[int, str]] = field(default_factory=list)

    def __call__(self, admin: Any, reason: str) -> None:
        for index, process in enumerate(self.processes):
            if process.admin is admin:
                self.replaced.append((index, reason))
                process.admin = None


def plane(
    *admins: FakeAdmin, workers: tuple[str, ...] = ()
) -> tuple[ControlPlane, DesiredFleet, Replacer]:
    config = build_config(
        {"discovery_timeout_s": 0.3},
        worker_urls=[f"grpc://{w}?model=m&runtime=sglang" for w in workers],
    )
    desired = DesiredFleet.of(config)
    processes = [FakeProcess(a) for a in admins]
    replacer = Replacer(processes)
    control = ControlPlane(
        config,
        desired,
        lambda: processes,
        replacer,
        read_timeout_s=READ_S,
        change_slack_s=SLACK_S,
    )
    return control, desired, replacer


# ------------------------------------------------------------------ reads


async def test_a_wedged_process_costs_a_list_one_deadline_and_is_left_out(
    strict: bool,
) -> None:
    """The list waits the read deadline (never less), asks the wedged process once (one
    deadline, not a retry), and leaves it out; the timing tier bounds the wait too."""
    answering = FakeAdmin({"a:1": worker("a:1", 2)})
    wedged = FakeAdmin({"a:1": worker("a:1", 7), "b:1": worker("b:1")}, wedged=True)
    control, _, replacer = plane(wedged, answering, workers=("a:1",))
    started = time.monotonic()
    listed = await control.ListWorkers(pb.ListWorkersRequest(), FakeContext())
    elapsed = time.monotonic() - started
    assert elapsed >= READ_S
    assert wedged.journal == ["asked", "expired"]
    if strict:
        assert elapsed < READ_S + LATE_S
    assert [(w.id, w.inflight) for w in listed.workers] == [("a:1", 2)]
    assert replacer.replaced == []  # a read replaces nobody: the liveness check does


async def test_every_wedged_process_is_asked_at_once_not_one_after_the_other(
    strict: bool,
) -> None:
    """All five asked before any deadline expired (no clock to read); within one
    deadline in the timing tier."""
    journal: list[str] = []
    admins = [FakeAdmin(wedged=True, journal=journal) for _ in range(5)]
    control, _, _ = plane(*admins)
    started = time.monotonic()
    assert await control.merged() == []
    assert journal == ["asked"] * 5 + ["expired"] * 5
    if strict:
        assert time.monotonic() - started < READ_S + LATE_S


async def test_a_slow_answer_within_the_deadline_counts() -> None:
    control, _, _ = plane(FakeAdmin({"a:1": worker("a:1")}, delay_s=READ_S / 2))
    assert [w.id for w in await control.merged()] == ["a:1"]


async def test_a_watch_event_is_merged_from_the_processes_that_answer(strict: bool) -> None:
    """The wedged process is asked once and left out (within one deadline in the timing
    tier)."""
    event = pb.WatchWorkersResponse(kind=pb.WORKER_EVENT_KIND_STATUS, worker=worker("a:1", 1))
    first = FakeAdmin({"a:1": worker("a:1", 1)}, events=[event])
    wedged = FakeAdmin(wedged=True)
    control, _, _ = plane(first, wedged, FakeAdmin({"a:1": worker("a:1", 4)}))
    seen = []
    started = time.monotonic()
    with pytest.raises(Aborted) as ended:
        async for answer in control.WatchWorkers(pb.WatchWorkersRequest(), FakeContext()):
            seen.append((answer.worker.id, answer.worker.inflight))
    if strict:
        assert time.monotonic() - started < READ_S + LATE_S
    assert wedged.journal == ["asked", "expired"]
    assert seen == [("a:1", 5)]
    assert ended.value.code is grpc.StatusCode.UNAVAILABLE  # the followed stream ended


async def test_within_tells_an_answer_an_error_and_no_answer_apart() -> None:
    async def answer() -> str:
        return "ok"

    async def refuse() -> None:
        raise rpc_error(grpc.StatusCode.NOT_FOUND, "no such worker")

    async def expire() -> None:
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)

    assert await within(answer(), 1.0) == "ok"
    refused = await within(refuse(), 1.0)
    assert isinstance(refused, aio.AioRpcError) and refused.code() is grpc.StatusCode.NOT_FOUND
    assert isinstance(await within(expire(), 1.0), NoAnswer)
    assert isinstance(await within(asyncio.Event().wait(), 0.01), NoAnswer)


# ------------------------------------------------------------------ changes


async def test_an_add_a_process_does_not_answer_stands_and_that_process_is_replaced(
    strict: bool,
) -> None:
    """Not a refusal: it is restarted from the desired fleet, which holds the worker.
    The add waits the discovery timeout and the slack, never less (and, in the timing
    tier, not much more)."""
    answering, wedged = FakeAdmin(), FakeAdmin(wedged=True)
    control, desired, replacer = plane(answering, wedged)
    started = time.monotonic()
    reply = await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    elapsed = time.monotonic() - started
    assert reply.worker.id == ADDED
    assert elapsed >= 0.3 + SLACK_S  # discovery timeout + slack
    if strict:
        assert elapsed < 0.3 + SLACK_S + LATE_S
    assert list(desired.specs) == [ADDED] and list(answering.workers) == [ADDED]
    assert replacer.replaced == [(1, "AddWorker: no answer within 0.5 s")]


async def test_an_add_one_refuses_while_another_hangs_is_undone_and_the_hung_one_replaced() -> None:
    refused = rpc_error(grpc.StatusCode.UNAVAILABLE, "worker did not tell its model")
    ok, refusing, wedged = FakeAdmin(), FakeAdmin(refuse_add=refused), FakeAdmin(wedged=True)
    control, desired, replacer = plane(ok, refusing, wedged)
    with pytest.raises(Aborted) as error:
        await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    assert (error.value.code, error.value.details) == (
        grpc.StatusCode.UNAVAILABLE,
        "worker did not tell its model",
    )
    assert desired.specs == {} and ok.workers == {}
    assert [index for index, _ in replacer.replaced] == [2]
    assert [name for name, _ in wedged.calls] == ["add"]  # no undo sent to a replaced one


async def test_an_add_nobody_answers_is_undone() -> None:
    control, desired, replacer = plane(FakeAdmin(wedged=True), FakeAdmin(wedged=True))
    with pytest.raises(Aborted) as error:
        await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    assert (error.value.code, error.value.details) == (
        grpc.StatusCode.UNAVAILABLE,
        "no serving process answered in time",
    )
    assert desired.specs == {} and [i for i, _ in replacer.replaced] == [0, 1]


async def test_a_removal_waits_for_its_drain_then_replaces_who_did_not_answer(
    strict: bool,
) -> None:
    drain_s = 0.3
    slow = FakeAdmin({"a:1": worker("a:1", 1)}, delay_s=drain_s)  # drains within its wait
    wedged = FakeAdmin({"a:1": worker("a:1", 2)}, wedged=True)
    control, desired, replacer = plane(slow, wedged, workers=("a:1",))
    request = pb.RemoveWorkerRequest(worker_id="a:1")
    request.drain_timeout.FromMilliseconds(int(drain_s * 1000))
    started = time.monotonic()
    removed = await control.RemoveWorker(request, FakeContext())
    elapsed = time.monotonic() - started
    assert elapsed >= drain_s + SLACK_S
    if strict:
        assert elapsed < drain_s + SLACK_S + LATE_S
    assert (removed.worker.id, removed.worker.inflight, removed.drained) == ("a:1", 1, True)
    assert desired.specs == {} and slow.workers == {}
    assert [index for index, _ in replacer.replaced] == [1]
    assert replacer.replaced[0][1].startswith("RemoveWorker: no answer")


async def test_a_drain_answers_from_the_processes_that_answer() -> None:
    answering = FakeAdmin({"a:1": worker("a:1", 0)})
    control, desired, replacer = plane(
        answering, FakeAdmin({"a:1": worker("a:1", 3)}, wedged=True), workers=("a:1",)
    )
    drained = await control.DrainWorker(pb.DrainWorkerRequest(worker_id="a:1"), FakeContext())
    assert (drained.worker.inflight, drained.drained) == (0, True)
    assert desired.drained == {"a:1"}
    assert [index for index, _ in replacer.replaced] == [1]


async def test_a_change_to_a_process_that_is_not_running_replaces_nothing() -> None:
    control, _, replacer = plane(FakeAdmin(), FakeAdmin(wedged=True))
    processes = replacer.processes
    processes[1].running = False  # died meanwhile: its keeper restarts it already
    await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    assert replacer.replaced == []


async def test_every_catch_up_call_has_a_deadline() -> None:
    desired = DesiredFleet.of(build_config(worker_urls=["grpc://k:1?model=m&runtime=sglang"]))
    desired.add(build_config(worker_urls=[URL]).workers[0], URL)
    desired.drained.add("k:1")
    admin = FakeAdmin({"k:1": worker("k:1"), "gone:1": worker("gone:1")})
    await reconcile(admin, desired, 0, discovery_timeout_s=5.0, timeout_s=2.0)
    assert [(name, kw.get("timeout")) for name, kw in admin.calls] == [
        ("list", 2.0),
        ("add", 7.0),
        ("remove", 2.0),
        ("drain", 2.0),
    ]


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
