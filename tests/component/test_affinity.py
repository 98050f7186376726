"""Session affinity, in process: with `affinity.header` set, a session's calls stay on the
worker its first call went to (round robin would spread them), move once when that
worker leaves and stay where they moved; a PD model keeps each leg's binding."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from gateway.app.server import Gateway
from gateway.core.roles import Role
from gateway.observability.record import CallRecord
from gateway_sim.client import collect, model_md, sgl_generate, sgl_grpc
from tests.support.inproc import Sim, client, gateway, recorded, sim, worker
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)

AFFINITY: dict[str, Any] = {"affinity.header": "x-session-id"}
SESSIONS, CALLS = 100, 10


def affinity_count(gw: Gateway, outcome: str) -> float:
    labels = {"model": "m", "outcome": outcome}
    return gw.parts.metrics.prometheus.get_sample_value("gateway_affinity_total", labels) or 0.0


def sessions_held(gw: Gateway) -> float:
    return gw.parts.metrics.prometheus.get_sample_value("gateway_affinity_sessions") or 0.0


@contextlib.asynccontextmanager
async def sims(count: int, name: str, *flags: str) -> AsyncIterator[list[Sim]]:
    """`count` simulated workers of model m, named `name`0, `name`1, ..."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(sim("--model", "m", "--name", f"{name}{i}", *flags))
            for i in range(count)
        ]


async def rounds(gw: Gateway, sessions: Sequence[str], calls: int, tag: str) -> None:
    """`calls` calls of every session, one after the other per session, sessions at once."""
    async with client(gw) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)

        async def session(name: str) -> None:
            for j in range(calls):
                md = model_md("m", ("x-session-id", name))
                call = stub.Generate(sgl_generate(f"{name}:{tag}{j}", 1, False), metadata=md)
                _, error = await collect(call)
                assert error is None

        await asyncio.gather(*(session(name) for name in sessions))


def by_session(records: Sequence[CallRecord], leg: Role = Role.REGULAR) -> dict[str, list[str]]:
    """Each session's workers of the leg, in the order its calls were placed."""
    found: dict[str, list[str]] = defaultdict(list)
    for record in sorted(records, key=lambda r: r.request_id or ""):
        assert record.code == "OK"
        session = (record.request_id or "").partition(":")[0]
        found[session] += record.legs[leg]
    return found


def first_worker_share(workers: Sequence[str]) -> float:
    return workers.count(workers[0]) / len(workers)


async def test_a_session_stays_on_its_worker_and_moves_once_when_it_leaves() -> None:
    async with (
        sims(4, "w") as workers,
        gateway(*(w.url(model="m") for w in workers), **AFFINITY) as gw,
    ):
        names = [f"s{i:03d}" for i in range(SESSIONS)]
        records = recorded(gw)
        await rounds(gw, names, CALLS, "a")
        await until(lambda: len(records) == SESSIONS * CALLS)
        placed = by_session(records)
        assert all(first_worker_share(placed[n]) >= 0.99 for n in names)
        homes = {n: placed[n][0] for n in names}
        assert len(set(homes.values())) == 4  # the policy spread the sessions' first calls
        assert affinity_count(gw, "miss") == SESSIONS
        assert affinity_count(gw, "hit") == SESSIONS * (CALLS - 1)
        assert sessions_held(gw) == SESSIONS

        gone = Counter(homes.values()).most_common(1)[0][0]
        moved = [n for n in names if homes[n] == gone]
        assert await gw.parts.fleet.remove(
            worker(gw, next(w for w in workers if w.address == gone)), 0
        )
        records.clear()
        await rounds(gw, names, CALLS, "b")
        await until(lambda: len(records) == SESSIONS * CALLS)
        after = by_session(records)
        for name in names:
            assert len(set(after[name])) == 1  # moved at most once, and stayed
            assert gone not in after[name]
            if name not in moved:
                assert after[name][0] == homes[name]  # the others never moved
        assert affinity_count(gw, "rebind") == len(moved)


async def test_pd_legs_each_keep_their_binding() -> None:
    async with (
        sims(2, "p", "--role", "prefill") as prefills,
        sims(2, "d", "--role", "decode") as decodes,
    ):
        urls = [
            *(
                p.url(model="m", role="prefill", bootstrap_port=p.side["bootstrap"])
                for p in prefills
            ),
            *(d.url(model="m", role="decode") for d in decodes),
        ]
        async with gateway(*urls, **AFFINITY) as gw:
            names = [f"s{i:02d}" for i in range(20)]
            records = recorded(gw)
            await rounds(gw, names, 5, "a")
            await until(lambda: len(records) == 20 * 5)
            for leg in (Role.PREFILL, Role.DECODE):
                placed = by_session(records, leg)
                assert all(len(set(placed[n])) == 1 for n in names)
                assert len({placed[n][0] for n in names}) == 2  # both workers of the leg used
            assert affinity_count(gw, "hit") == 20 * 4 * 2
            assert sessions_held(gw) == 20 * 2
