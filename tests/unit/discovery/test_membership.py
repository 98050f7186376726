"""Membership: sources' reports applied to the fleet's door. The fleet here is a stand-in
that records what the door was asked (join, name, in/out of service, remove), so each
rule is checked alone; the e2e tests run the real fleet."""

from __future__ import annotations

import asyncio
from typing import Any

from structlog.testing import capture_logs

from gateway.config import WorkerSpec
from gateway.core.roles import Runtime
from gateway.discovery.membership import Membership
from gateway.discovery.source import Discovered
from gateway.upstream.registry import Registry
from gateway.upstream.worker import Worker
from tests.support.factories import make_registry, make_worker


class Door:
    """The fleet's door as Membership uses it; joins register at once, removals wait
    for `release` (a drain in progress)."""

    def __init__(self) -> None:
        self.registry: Registry = make_registry()
        self.log: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    def has(self, address: str) -> bool:
        return self.registry.get(address) is not None

    def join(self, spec: WorkerSpec, sources: tuple[str, ...]) -> asyncio.Task[None]:
        worker = make_worker(spec, spec.model or "m", Runtime.SGLANG)
        worker.named_by(sources)
        self.registry.add(worker)
        self.log.append(f"join {spec.address} {','.join(sources)}")
        return asyncio.ensure_future(asyncio.sleep(0))

    def name(self, worker: Worker, sources: tuple[str, ...]) -> None:
        if sources != worker.sources:
            self.log.append(f"name {worker.id} {','.join(sources)}")
        worker.named_by(sources)

    def set_in_service(self, worker: Worker, in_service: bool, cause: str) -> None:
        if in_service != worker.in_service:
            self.log.append(f"{'in' if in_service else 'out'} {worker.id}")
        worker.set_in_service(in_service, cause)

    async def remove(self, worker: Worker, drain_timeout_s: float) -> bool:
        self.log.append(f"drain {worker.id}")
        await self.release.wait()
        self.registry.remove(worker)
        self.log.append(f"removed {worker.id}")
        return True


def host(port: int, origin: str = "dns:w", in_service: bool = True, model: str = "m") -> Any:
    return Discovered(WorkerSpec("10.0.0.1", port, model, Runtime.SGLANG), origin, in_service)


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def membership(door: Door, **grace: float) -> Membership:
    # Leaving at once, not spread: each step here is a turn of the event loop.
    return Membership(door, drain_timeout_s=1.0, grace_s=grace, spread=lambda _: 0.0)  # type: ignore[arg-type]


async def test_hosts_join_and_leave_with_their_source() -> None:
    door = Door()
    m = membership(door)
    m.apply("dns:w", [host(1), host(2)])
    await settled()
    m.apply("dns:w", [host(2)])
    await settled()
    assert door.log == ["join 10.0.0.1:1 dns:w", "join 10.0.0.1:2 dns:w", "drain 10.0.0.1:1",
                        "removed 10.0.0.1:1"]  # fmt: skip
    assert [w.id for w in door.registry] == ["10.0.0.1:2"]
    await m.close()


async def test_two_sources_naming_one_address_are_one_host_that_leaves_with_the_last() -> None:
    door = Door()
    m = membership(door)
    m.apply("dns:w", [host(1)])
    await settled()
    m.apply("file:/x", [host(1, origin="file:/x")])
    m.apply("dns:w", [])
    await settled()
    assert door.log == ["join 10.0.0.1:1 dns:w", "name 10.0.0.1:1 dns:w,file:/x",
                        "name 10.0.0.1:1 file:/x"]  # fmt: skip
    m.apply("file:/x", [])
    await settled()
    assert door.log[-2:] == ["drain 10.0.0.1:1", "removed 10.0.0.1:1"]
    await m.close()


async def test_a_static_host_that_a_source_also_lists_never_leaves_by_discovery() -> None:
    door = Door()
    static = make_worker(WorkerSpec("10.0.0.1", 1, "m", Runtime.SGLANG))
    door.registry.add(static)
    m = membership(door)
    m.apply("dns:w", [host(1)])
    m.apply("dns:w", [])
    await settled()
    assert door.log == ["name 10.0.0.1:1 dns:w,static", "name 10.0.0.1:1 static"]
    assert door.registry.get("10.0.0.1:1") is static
    await m.close()


async def test_out_of_service_is_at_once_and_leaving_after_the_grace() -> None:
    door = Door()
    m = membership(door, **{"kubernetes:ns/app=x": 0.05})
    source = "kubernetes:ns/app=x"
    pod = "kubernetes:ns/pod-1"
    m.apply(source, [host(1, pod, in_service=False)])
    await settled()
    assert door.log == []  # never in service: not joined
    m.apply(source, [host(1, pod)])
    await settled()
    m.apply(source, [host(1, pod, in_service=False)])
    await settled()
    m.apply(source, [host(1, pod)])  # a flap shorter than the grace: it stays
    await settled()
    assert door.log == ["join 10.0.0.1:1 kubernetes:ns/pod-1", "out 10.0.0.1:1", "in 10.0.0.1:1"]
    m.apply(source, [host(1, pod, in_service=False)])
    for _ in range(100):
        if door.log[-1] == "removed 10.0.0.1:1":
            break
        await asyncio.sleep(0.01)
    assert door.log[-3:] == ["out 10.0.0.1:1", "drain 10.0.0.1:1", "removed 10.0.0.1:1"]
    await m.close()


async def test_a_host_listed_again_while_it_drains_comes_back_fresh() -> None:
    door = Door()
    door.release.clear()
    m = membership(door)
    m.apply("dns:w", [host(1)])
    await settled()
    first = door.registry.get("10.0.0.1:1")
    m.apply("dns:w", [])
    await settled()
    m.apply("dns:w", [host(1)])  # back while the old one still drains
    await settled()
    assert door.log[-1] == "drain 10.0.0.1:1"
    door.release.set()
    await settled()
    again = door.registry.get("10.0.0.1:1")
    assert again is not None and again is not first
    assert door.log[-2:] == ["removed 10.0.0.1:1", "join 10.0.0.1:1 dns:w"]
    await m.close()


async def test_a_second_source_naming_another_model_at_the_address_is_ignored() -> None:
    door = Door()
    m = membership(door)
    m.apply("dns:w", [host(1, model="m")])
    await settled()
    m.apply("file:/x", [host(1, origin="file:/x", model="other")])
    await settled()
    worker = door.registry.get("10.0.0.1:1")
    assert worker is not None and worker.sources == ("dns:w",)
    await m.close()


async def test_first_reports_waits_for_every_source_bounded() -> None:
    door = Door()
    m = membership(door)
    assert await m.first_reports(["dns:w"], 0.01) is False
    m.apply("dns:w", [host(1)])
    assert await m.first_reports(["dns:w"], 1.0) is True
    await m.close()


async def test_a_host_dropped_while_it_joins_stops_joining() -> None:
    door = Door()
    never = asyncio.Event()
    joins: list[asyncio.Task[None]] = []

    async def hang() -> None:
        await never.wait()

    def join(spec: WorkerSpec, sources: tuple[str, ...]) -> asyncio.Task[None]:
        joins.append(asyncio.ensure_future(hang()))  # a worker that never answers
        return joins[-1]

    door.join = join  # type: ignore[method-assign]
    m = membership(door)
    m.apply("dns:w", [host(1)])
    await settled()
    assert len(joins) == 1 and not joins[0].done()
    m.apply("dns:w", [])
    await settled()
    assert joins[0].cancelled()
    m.apply("dns:w", [host(1)])  # listed again: a new join
    await settled()
    assert len(joins) == 2 and not joins[1].done()
    await m.close()
    assert joins[1].cancelled()


async def test_a_conflict_warning_is_forgotten_once_its_source_stops_naming_the_address() -> None:
    door = Door()
    m = membership(door)
    with capture_logs() as logs:
        m.apply("dns:w", [host(1, model="m")])
        await settled()
        conflict = [host(1, origin="file:/x", model="other")]
        m.apply("file:/x", conflict)
        m.apply("file:/x", conflict)  # the same conflict: warned once
        assert m._warned == {"10.0.0.1:1": {"file:/x"}}
        m.apply("file:/x", [])  # the conflict ends: nothing of it is kept
        assert m._warned == {}
        m.apply("file:/x", conflict)  # a new conflict: warned again
        m.apply("file:/x", [])
        m.apply("dns:w", [])
        await settled()
    assert [e["event"] for e in logs].count("discovery_conflict") == 2
    assert m._warned == {} and [w.id for w in door.registry] == []
    await m.close()
