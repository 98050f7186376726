"""Tasks and timers: the fleet cancels every timer it set for a worker when the worker is
removed (and all of them when it closes); stopping a component never swallows the
cancellation of whoever is stopping it; the KV follower opens its channel through the
fleet's `connect`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.app.connections import ConnectionWatch
from gateway.config import build_config
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.upstream.load.kv_events import KvFollower
from gateway.upstream.manager import Fleet
from gateway.upstream.registry import FleetEvent
from gateway.upstream.signals.outlier import BreakerState, Outcome
from gateway.upstream.worker import Worker, WorkerStatus
from tests.unit.factories import make_worker


def fleet_with_worker(**overrides: Any) -> tuple[Fleet, Worker, list[FleetEvent]]:
    config = build_config(
        overrides={"breaker.cooldown_s": 0.05, "kv.grace_s": 0.05, **overrides},
        worker_urls=["grpc://h:1?model=m&runtime=sglang"],
    )
    fleet = Fleet(config, engine_adapters())
    (spec,) = config.workers
    worker = make_worker(spec, breaker=fleet.settings.breaker)
    fleet.registry.add(worker)
    events: list[FleetEvent] = []
    fleet.registry.subscribe(events.append)
    return fleet, worker, events


def open_breaker(fleet: Fleet, worker: Worker) -> None:
    for _ in range(fleet.settings.breaker.failure_threshold):
        fleet.record_outcome(worker, Outcome.FAILURE, trial=False)
    assert worker.breaker.state is BreakerState.OPEN


def make_ready_then_not(fleet: Fleet, worker: Worker) -> None:
    worker.connected, worker.probe.healthy = True, True
    fleet.registry.update(worker, "probe")
    assert worker.status is WorkerStatus.READY
    worker.connected = False
    fleet.registry.update(worker, "connection closed")  # ready -> not ready: a cache timer


async def test_removing_a_worker_cancels_its_timers() -> None:
    fleet, worker, events = fleet_with_worker()
    open_breaker(fleet, worker)  # the cool-down's end is a timer
    make_ready_then_not(fleet, worker)  # so is forgetting its cache
    timers = set(fleet._timers[worker.id])
    assert len(timers) == 2
    await fleet.remove(worker, 0.0)
    assert fleet._timers == {} and all(t.cancelled() for t in timers)
    events.clear()
    await asyncio.sleep(0.15)
    assert events == []  # no "cool-down over" for a worker that is gone
    # An outcome reported after the removal (a request that was in flight) sets none.
    fleet.record_outcome(worker, Outcome.FAILURE, trial=True)
    assert fleet._timers == {}
    await fleet.close()


async def test_a_timer_that_fires_forgets_itself() -> None:
    fleet, worker, events = fleet_with_worker()
    open_breaker(fleet, worker)
    await asyncio.sleep(0.15)
    assert [e.cause for e in events if e.kind == "breaker"][-1] == "cool-down over"
    assert fleet._timers == {worker.id: set()}
    await fleet.close()


async def test_closing_the_fleet_cancels_every_timer() -> None:
    fleet, worker, _ = fleet_with_worker()
    open_breaker(fleet, worker)
    (timer,) = fleet._timers[worker.id]
    await fleet.close()
    assert timer.cancelled() and fleet._timers == {}


async def test_a_worker_removed_and_added_again_keeps_its_new_cache_entries() -> None:
    fleet, worker, _ = fleet_with_worker()
    make_ready_then_not(fleet, worker)
    stale = next(iter(fleet._timers[worker.id]))
    await fleet.remove(worker, 0.0)
    again = make_worker(worker.spec, breaker=fleet.settings.breaker)
    fleet.registry.add(again)
    dropped: list[str] = []
    fleet.kv_index.drop_worker = dropped.append  # type: ignore[method-assign]
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


async def cancelled_while_stopping(stop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
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
    task = fleet._spawn(worker.id, stubborn(release))
    stopping = await cancelled_while_stopping(fleet.close)
    assert stopping.cancelled()
    await asyncio.sleep(0)
    assert task.cancelled()  # the caller's cancellation reached the task it waited for


async def test_a_cancelled_fleet_remove_is_cancelled_not_swallowed() -> None:
    fleet, worker, _ = fleet_with_worker()
    release = asyncio.Event()
    fleet._spawn(worker.id, stubborn(release))
    stopping = await cancelled_while_stopping(lambda: fleet.remove(worker, 0.0))
    assert stopping.cancelled()
    await fleet.close()


async def test_a_cancelled_connection_watch_stop_is_cancelled_not_swallowed() -> None:
    watch = ConnectionWatch(port=1, cap=10, per_peer=10)
    release = asyncio.Event()
    watch._task = asyncio.ensure_future(stubborn(release))
    stopping = await cancelled_while_stopping(watch.stop)
    assert stopping.cancelled()
    # And a plain stop still ends quietly: the task's own cancellation is not an error.
    watch._task = asyncio.ensure_future(asyncio.sleep(3600))
    await watch.stop()
    assert watch._task is None


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
