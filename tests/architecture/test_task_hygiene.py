"""Tasks and timers: no module but gateway/core/tasks.py starts a bare task (each has an
owner that cancels and awaits it), nor does any module of the simulator (sim/gateway_sim:
an asyncio.TaskGroup owns its tasks); the fleet cancels every timer it set for a worker when
the worker is removed (and all of them when it closes); stopping a component never
swallows the cancellation of whoever is stopping it; the KV follower opens its channel
through the fleet's `connect`."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app.connections import ConnectionWatch
from gateway.config import build_config
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.placement.policies import build_policy
from gateway.upstream.load.kv_events import KvFollower
from gateway.upstream.manager import Fleet
from gateway.upstream.registry import FleetEvent
from gateway.upstream.signals.outlier import Outcome, OutlierState
from gateway.upstream.worker import Worker, WorkerStatus
from tests.support.factories import make_worker

ROOT = Path(__file__).resolve().parents[2]
HELPER = "gateway/core/tasks.py"  # the one place that creates tasks
CHECKED = ("gateway", "sim/gateway_sim")  # the gateway's modules and the simulator's
SPAWNERS = frozenset({"ensure_future", "create_task"})  # asyncio's, a loop's
# Files allowed to start a bare task, each with why (a file leaves the list once it starts
# none: the test below fails while a listed file is clean). None today.
ALLOWED: dict[str, str] = {}


def task_groups(tree: ast.AST) -> set[str]:
    """Names bound by `async with asyncio.TaskGroup() as name:` (whose create_task is
    structured: the group awaits its children)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                made = item.context_expr
                if (
                    isinstance(made, ast.Call)
                    and _name(made.func) == "TaskGroup"
                    and isinstance(item.optional_vars, ast.Name)
                ):
                    names.add(item.optional_vars.id)
    return names


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def bare_spawns(source: str) -> Iterator[int]:
    """The lines that start a task with no owner: `ensure_future`, `create_task` (a loop's
    or asyncio's, called, passed on or imported), `asyncio.Task(...)`; a TaskGroup's
    `create_task` is not one."""
    tree = ast.parse(source)
    groups = task_groups(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt | ast.expr) and _is_bare_spawn(node, groups):
            yield node.lineno


def _is_bare_spawn(node: ast.AST, groups: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in SPAWNERS:
        return not (isinstance(node.value, ast.Name) and node.value.id in groups)
    if isinstance(node, ast.Name):
        return node.id in SPAWNERS
    if isinstance(node, ast.ImportFrom):
        return any(alias.name in SPAWNERS for alias in node.names)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "Task" and _name(node.func.value) == "asyncio"
    return False


def spawns_by_file() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted(p for top in CHECKED for p in (ROOT / top).rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        lines = sorted(set(bare_spawns(path.read_text())))
        if lines and name != HELPER:
            found[name] = lines
    return found


def test_no_module_but_the_helper_starts_a_bare_task() -> None:
    offenders = [
        f"{name}:{line}"
        for name, lines in spawns_by_file().items()
        if name not in ALLOWED
        for line in lines
    ]
    assert offenders == [], (
        "start tasks through gateway.core.tasks (TaskScope), in the simulator under an "
        "asyncio.TaskGroup, instead"
    )


def test_every_allowed_file_still_starts_one() -> None:
    found = spawns_by_file()
    clean = [name for name in ALLOWED if name not in found]
    assert clean == [], "no bare task left there: take it off ALLOWED"
    assert all((ROOT / name).is_file() for name in ALLOWED)


def test_the_check_sees_each_way_of_starting_a_bare_task() -> None:
    bare = """
import asyncio
from asyncio import create_task
a = asyncio.ensure_future(work())
b = asyncio.get_running_loop().create_task(work())
c = loop.create_task(work())
d = asyncio.Task(work())
spawn = asyncio.create_task
"""
    assert sorted(set(bare_spawns(bare))) == [3, 4, 5, 6, 7, 8]
    structured = """
async def f():
    async with asyncio.TaskGroup() as legs:
        legs.create_task(work())
    await asyncio.gather(work(), work())
"""
    assert list(bare_spawns(structured)) == []


def own(fleet: Fleet, worker: Worker, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A task of the fleet's for `worker`, as its loops are."""
    return fleet._own(worker.id, fleet._scope.spawn(coro, "test", worker=worker.id))


def fleet_with_worker(**overrides: Any) -> tuple[Fleet, Worker, list[FleetEvent]]:
    config = build_config(
        overrides={"outlier_detection.cooldown_s": 0.05, "kv.grace_s": 0.05, **overrides},
        worker_urls=["grpc://h:1?model=m&runtime=sglang"],
    )
    fleet = Fleet(config, engine_adapters(), build_policy)
    (spec,) = config.workers
    worker = make_worker(spec, outlier=fleet.settings.outlier_detection)
    fleet.registry.add(worker)
    events: list[FleetEvent] = []
    fleet.registry.subscribe(events.append)
    return fleet, worker, events


def eject(fleet: Fleet, worker: Worker) -> None:
    for _ in range(fleet.settings.outlier_detection.failure_threshold):
        fleet.record_outcome(worker, Outcome.FAILURE, trial=False)
    assert worker.outlier.state is OutlierState.OPEN


def make_ready_then_not(fleet: Fleet, worker: Worker) -> None:
    worker.connected, worker.probe.healthy = True, True
    worker.signalled("probe")
    assert worker.status is WorkerStatus.READY
    worker.connected = False
    worker.signalled("connection closed")  # ready -> not ready: a cache timer


async def test_removing_a_worker_cancels_its_timers() -> None:
    fleet, worker, events = fleet_with_worker()
    eject(fleet, worker)  # the cool-down's end is the detector's timer
    cooldown = worker.outlier._cooldown
    assert cooldown is not None
    make_ready_then_not(fleet, worker)  # forgetting its cache is the fleet's
    timers = set(fleet._timers[worker.id])
    assert len(timers) == 1
    await fleet.remove(worker, 0.0)
    assert fleet._timers == {} and all(t.cancelled() for t in timers) and cooldown.cancelled()
    events.clear()
    await asyncio.sleep(0.15)
    assert events == []  # no "cool-down over" for a worker that is gone
    # An outcome reported after the removal (a request that was in flight) sets none.
    fleet.record_outcome(worker, Outcome.FAILURE, trial=True)
    assert fleet._timers == {} and worker.outlier._cooldown is None
    await fleet.close()


async def test_a_timer_that_fires_forgets_itself() -> None:
    fleet, worker, events = fleet_with_worker()
    eject(fleet, worker)
    await asyncio.sleep(0.15)
    assert [e.cause for e in events if e.kind == "outlier"][-1] == "cool-down over"
    assert worker.outlier._cooldown is None and fleet._timers == {}
    await fleet.close()


async def test_closing_the_fleet_cancels_every_timer() -> None:
    fleet, worker, _ = fleet_with_worker()
    eject(fleet, worker)
    make_ready_then_not(fleet, worker)
    (timer,) = fleet._timers[worker.id]
    cooldown = worker.outlier._cooldown
    await fleet.close()
    assert timer.cancelled() and fleet._timers == {}
    assert cooldown is not None and cooldown.cancelled()


async def test_a_worker_removed_and_added_again_keeps_its_new_cache_entries() -> None:
    fleet, worker, _ = fleet_with_worker()
    make_ready_then_not(fleet, worker)
    stale = next(iter(fleet._timers[worker.id]))
    await fleet.remove(worker, 0.0)
    again = make_worker(worker.spec, outlier=fleet.settings.outlier_detection)
    fleet.registry.add(again)
    dropped: list[str] = []

    def drop_worker(worker_id: str) -> None:
        dropped.append(worker_id)

    fleet.kv_index.drop_worker = drop_worker  # type: ignore[method-assign]
    stale._run()  # even if the old timer ran, it is about the old worker object
    assert dropped == []
    await fleet.close()


async def stubborn(release: asyncio.Event) -> None:
    """A task that, once cancelled, takes its time to end (cleanup that awaits)."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await release.wait()
        raise


async def cancelled_while_stopping(stop: Callable[[], Awaitable[object]]) -> asyncio.Task[object]:
    stopping = asyncio.ensure_future(stop())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not stopping.done()  # waiting for the stubborn task
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    return stopping


async def test_a_cancelled_fleet_close_is_cancelled_not_swallowed() -> None:
    fleet, worker, _ = fleet_with_worker()
    release = asyncio.Event()
    task = own(fleet, worker, stubborn(release))
    stopping = await cancelled_while_stopping(fleet.close)
    assert stopping.cancelled()
    await asyncio.sleep(0)
    assert task.cancelled()  # the caller's cancellation reached the task it waited for


async def test_a_cancelled_fleet_remove_is_cancelled_not_swallowed() -> None:
    fleet, worker, _ = fleet_with_worker()
    release = asyncio.Event()
    own(fleet, worker, stubborn(release))
    stopping = await cancelled_while_stopping(lambda: fleet.remove(worker, 0.0))
    assert stopping.cancelled()
    await fleet.close()


async def test_a_cancelled_connection_watch_stop_is_cancelled_not_swallowed() -> None:
    watch = ConnectionWatch(ports=(1,), cap=10, per_peer=10)
    release = asyncio.Event()
    watch._tasks.spawn(stubborn(release), "stubborn")
    stopping = await cancelled_while_stopping(watch.stop)
    assert stopping.cancelled()
    # And a plain stop still ends quietly: the task's own cancellation is not an error.
    watch._tasks.spawn(asyncio.sleep(3600), "sleeper")
    await watch.stop()
    assert not watch._tasks


def test_the_kv_follower_opens_its_channel_through_connect() -> None:
    config = build_config(overrides={"kv.max_event_bytes": 1234})
    _, worker, _ = fleet_with_worker()
    opened: list[int] = []
    own = object()

    def connect(limit: int) -> Any:
        opened.append(limit)
        return own

    adapter = engine_adapters()[Runtime.SGLANG]
    follower = KvFollower(worker, adapter, KvIndex(), settings=config.kv, connect=connect)
    assert follower._open() is own and opened == [1234]
