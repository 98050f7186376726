"""The task helper: a supervised loop restarts after its pause and logs a repeating
failure once; a scope's close cancels and awaits every child, leaves no task behind and
never swallows the cancellation of whoever closes it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from gateway.core import tasks as tasks_module
from gateway.core.tasks import TaskScope, cancel_and_wait


async def ticks(n: int = 10) -> None:
    """Let every ready task run a few times (no wall clock involved)."""
    for _ in range(n):
        await asyncio.sleep(0)


def failing(errors: list[Exception], done: asyncio.Event) -> tuple[Callable[[], Any], list[int]]:
    """A loop body that raises each of `errors` in turn, then returns."""
    runs: list[int] = []

    async def run() -> None:
        runs.append(1)
        if len(runs) <= len(errors):
            raise errors[len(runs) - 1]
        done.set()

    return run, runs


def failures(logs: Sequence[Mapping[str, Any]]) -> list[str]:
    return [e["error"] for e in logs if e["event"] == "loop_failed"]


async def test_a_supervised_loop_that_raises_runs_again_after_its_pause() -> None:
    done = asyncio.Event()
    run, runs = failing([ValueError("bad answer"), ValueError("bad answer")], done)
    scope = TaskScope()
    with capture_logs() as logs:
        task = scope.supervise("probe", run, pause_s=0.001, worker="h:1")
        async with asyncio.timeout(10):
            await done.wait()
        await task
        await ticks(1)  # its done callbacks run
    assert len(runs) == 3 and len(scope) == 0
    (failure,) = [e for e in logs if e["event"] == "loop_failed"]
    assert failure["loop"] == "probe" and failure["worker"] == "h:1"
    assert failure["error"] == "ValueError('bad answer')"
    assert isinstance(failure["exc_info"], ValueError)
    assert failure["log_level"] == "error"


async def test_a_supervised_loop_waits_out_its_pause_before_it_runs_again() -> None:
    done = asyncio.Event()
    run, runs = failing([ValueError("once")], done)
    scope = TaskScope()
    with capture_logs():
        task = scope.supervise("loads", run, pause_s=3600.0)
        await ticks(50)
        assert runs == [1] and not task.done()  # asleep in its pause
        await scope.close()
    assert task.cancelled() and not done.is_set()


async def test_the_default_pause_is_read_when_due(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks_module, "RESTART_S", 0.0)
    done = asyncio.Event()
    run, runs = failing([ValueError("x")] * 3, done)
    with capture_logs():
        async with TaskScope() as scope:
            scope.supervise("kv_events", run)
            async with asyncio.timeout(10):
                await done.wait()
    assert len(runs) == 4


async def test_a_failure_is_logged_once_while_it_repeats_and_again_once_it_changes() -> None:
    done = asyncio.Event()
    a, b = ValueError("a"), KeyError("b")
    run, _ = failing([a, a, a, b, b, ValueError("a")], done)
    with capture_logs() as logs:
        async with TaskScope() as scope:
            scope.supervise("source", run, pause_s=0.0)
            async with asyncio.timeout(10):
                await done.wait()
    assert failures(logs) == ["ValueError('a')", "KeyError('b')", "ValueError('a')"]


async def test_the_same_failure_after_a_long_run_is_logged_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tasks_module, "RECOVERED_S", 0.0)  # every run counts as long
    done = asyncio.Event()
    run, _ = failing([ValueError("a")] * 3, done)
    with capture_logs() as logs:
        async with TaskScope() as scope:
            scope.supervise("source", run, pause_s=0.0)
            async with asyncio.timeout(10):
                await done.wait()
    assert failures(logs) == ["ValueError('a')"] * 3


async def test_close_cancels_and_awaits_every_child_and_leaves_no_task() -> None:
    before = asyncio.all_tasks()
    scope = TaskScope()
    children = [scope.spawn(asyncio.sleep(3600), "sleeper", n=n) for n in range(5)]
    children.append(scope.supervise("forever", lambda: asyncio.sleep(3600)))
    await ticks()
    assert len(scope) == 6
    await scope.close()
    assert all(child.cancelled() for child in children)
    assert len(scope) == 0 and asyncio.all_tasks() == before


async def test_a_child_that_ignores_its_cancellation_once_is_still_awaited() -> None:
    before = asyncio.all_tasks()
    release = asyncio.Event()
    cleaned: list[str] = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await release.wait()  # cleanup that takes its time, then a normal end
            cleaned.append("done")

    scope = TaskScope()
    child = scope.spawn(stubborn(), "stubborn")
    await ticks()
    closing = asyncio.ensure_future(scope.close())
    await ticks(50)
    assert not closing.done() and not child.done()  # close waits for the cleanup
    release.set()
    await closing
    assert cleaned == ["done"] and child.done() and not child.cancelled()
    assert asyncio.all_tasks() == before


async def test_a_cancelled_close_is_cancelled_and_the_children_still_end() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await release.wait()
            raise

    scope = TaskScope()
    child = scope.spawn(stubborn(), "stubborn")
    await ticks()
    closing = asyncio.ensure_future(scope.close())
    await ticks()
    assert not closing.done()
    closing.cancel()  # reaches the child, in its cleanup, as well
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert closing.cancelled() and child.cancelled()


async def test_a_task_started_while_the_scope_closes_is_cancelled_too() -> None:
    scope = TaskScope()
    late: list[asyncio.Task[None]] = []

    async def parent() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            late.append(scope.spawn(asyncio.sleep(3600), "late"))

    scope.spawn(parent(), "parent")
    await ticks()
    await scope.close()
    assert len(late) == 1 and late[0].cancelled() and len(scope) == 0


async def test_a_failed_task_is_logged_once_at_once_and_its_error_stays_readable() -> None:
    async def broken() -> None:
        raise RuntimeError("bug")

    scope = TaskScope()
    with capture_logs() as logs:
        task = scope.spawn(broken(), "leave", worker="h:1")
        await ticks()
    assert [(e["event"], e["task"], e["worker"], e["error"]) for e in logs] == [
        ("task_failed", "leave", "h:1", "RuntimeError('bug')")
    ]
    with pytest.raises(RuntimeError):
        await task  # an owner that awaits it still gets the error
    assert len(scope) == 0


async def test_a_scope_whose_owner_reads_the_outcomes_logs_nothing() -> None:
    async def broken() -> None:
        raise RuntimeError("an answer, not a bug")

    with capture_logs() as logs:
        async with TaskScope(log_failures=False) as scope:
            task = scope.spawn(broken(), "query")
            await asyncio.wait([task])
    assert logs == [] and isinstance(task.exception(), RuntimeError)


async def test_leaving_the_block_on_an_error_cancels_the_children() -> None:
    child: asyncio.Task[None] | None = None
    with pytest.raises(LookupError):
        async with TaskScope() as scope:
            child = scope.spawn(asyncio.sleep(3600), "sleeper")
            await ticks()
            raise LookupError
    assert child is not None and child.cancelled()


async def test_cancel_and_wait_takes_tasks_that_ended_already() -> None:
    async def quick() -> int:
        return 1

    done = asyncio.ensure_future(quick())
    await done
    await cancel_and_wait([done])
    await cancel_and_wait([])
    assert done.result() == 1
