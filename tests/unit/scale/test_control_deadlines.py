"""Deadlines in the control plane of `--processes N`, with fake processes (no process is
started): a process that does not answer is left out of reads, and replaced after a change
it did not answer. Short deadlines keep these fast."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as pb
from gateway.config import build_config
from gateway.scale.control import ControlPlane, NoAnswer, within
from gateway.scale.desired import DesiredFleet, reconcile
from tests.support.control_plane import LATE_S, FakeAdmin, worker
from tests.support.fakes.context import Aborted, FakeContext

READ_S = 0.2  # the read deadline in these tests
SLACK_S = 0.2  # a change's deadline on top of the wait it asks for
URL = "grpc://127.0.0.1:7001?model=m&runtime=sglang"
ADDED = "127.0.0.1:7001"


def rpc_error(code: grpc.StatusCode, details: str = "") -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details)


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
