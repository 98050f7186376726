"""LoRA adapters, in process: 4 simulated SGLang workers holding at most 2 adapters each
(`--max-loras 2`, loads taking 20 ms), 6 adapters the gateway may load on demand. A
simulated worker refuses a Generate naming an adapter it does not hold, so a call that
succeeds was served where its adapter was loaded."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2

from gateway.app.server import Gateway
from gateway_sim.client import collect, model_md, sgl_generate, sgl_grpc
from gateway_sim.hostile import Hostile, hostile
from tests.support.helpers import rich_status
from tests.support.inproc import Sim, client, gateway, idle, sim, worker
from tests.support.waits import until

pytestmark = pytest.mark.timeout(120)

ADAPTERS = [f"a{i}" for i in range(6)]
LORA: dict[str, Any] = {
    "lora.adapters": {name: f"/models/loras/{name}" for name in ADAPTERS},
    "lora.max_loaded_per_worker": 2,
}
POLLED: dict[str, Any] = {**LORA, "loads.interval_s": 0.05}
SIM_FLAGS = ("--max-loras", "2", "--lora-load-ms", "20")


def loads(gw: Gateway, outcome: str = "loaded") -> float:
    labels = {"model": "m", "outcome": outcome}
    return gw.parts.metrics.prometheus.get_sample_value("gateway_lora_loads_total", labels) or 0.0


def evictions(gw: Gateway) -> float:
    labels = {"model": "m"}
    return (
        gw.parts.metrics.prometheus.get_sample_value("gateway_lora_evictions_total", labels) or 0.0
    )


@contextlib.asynccontextmanager
async def sims(flags: Sequence[Sequence[str]]) -> AsyncIterator[list[Sim]]:
    """One simulated worker of model m per entry, with its flags."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(sim("--model", "m", "--name", f"w{i}", *extra))
            for i, extra in enumerate(flags)
        ]


def lora_call(request_id: str, adapter: str) -> Any:
    request = sgl_generate(request_id, 2, False)
    request.lora_id = adapter
    return request


async def call(gw: Gateway, request_id: str, adapter: str) -> grpc.aio.AioRpcError | None:
    async with client(gw) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        _, error = await collect(
            stub.Generate(lora_call(request_id, adapter), metadata=model_md("m"))
        )
    return error


async def test_calls_go_where_their_adapter_is_and_load_only_on_a_miss() -> None:
    async with (
        sims([SIM_FLAGS] * 4) as workers,
        gateway(*(w.url(model="m") for w in workers), **LORA) as gw,
    ):
        for i in range(10):  # two adapters, one after the other: one load each
            for adapter in ADAPTERS[:2]:
                assert await call(gw, f"warm{i}{adapter}", adapter) is None
        assert loads(gw) == 2
        for i in range(5):  # all six fit (4 workers x 2): each loaded once, never again
            results = await asyncio.gather(
                *(call(gw, f"all{i}{adapter}", adapter) for adapter in ADAPTERS)
            )
            assert results == [None] * len(ADAPTERS)
        assert loads(gw) == len(ADAPTERS) and evictions(gw) == 0
        held = [a for w in workers for a in worker(gw, w).loras]
        assert sorted(held) == ADAPTERS
        gauge = gw.parts.metrics.prometheus.get_sample_value(
            "gateway_worker_lora_adapters", {"worker": workers[0].address}
        )
        assert gauge == len(worker(gw, workers[0]).loras)


async def test_a_full_fleet_evicts_the_least_recently_used_adapter() -> None:
    async with (
        sims([SIM_FLAGS] * 2) as workers,
        gateway(*(w.url(model="m") for w in workers), **LORA) as gw,
    ):
        for i in range(3):
            for adapter in ADAPTERS:  # 6 adapters over 4 slots, one call at a time
                assert await call(gw, f"r{i}{adapter}", adapter) is None
        assert evictions(gw) > 0
        assert loads(gw) == 4 + evictions(gw)  # every load past the first four made room
        assert all(len(worker(gw, w).loras) == 2 for w in workers)


async def test_a_worker_that_cannot_load_never_fails_a_call_another_can_serve() -> None:
    flags = [("--max-loras", "0"), SIM_FLAGS, SIM_FLAGS, SIM_FLAGS]
    async with (
        sims(flags) as workers,
        gateway(*(w.url(model="m") for w in workers), **LORA) as gw,
    ):
        for i in range(4):
            results = await asyncio.gather(
                *(call(gw, f"r{i}{adapter}", adapter) for adapter in ADAPTERS[:4])
            )
            assert results == [None] * 4
        assert loads(gw, "failed") >= 1
        assert worker(gw, workers[0]).loras == ()


async def test_no_worker_can_load_it_is_adapter_load_failed() -> None:
    async with (
        sims([("--max-loras", "0")] * 2) as workers,
        gateway(*(w.url(model="m") for w in workers), **LORA) as gw,
    ):
        error = await call(gw, "r", "a0")
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        _, details = rich_status(error)
        assert details["ErrorInfo"].reason == "ADAPTER_LOAD_FAILED"
        assert details["RetryInfo"].retry_delay.ToMilliseconds() == 1000
        assert loads(gw, "failed") == 2


async def test_an_unknown_adapter_is_not_found() -> None:
    async with (
        sims([SIM_FLAGS] * 2) as workers,
        gateway(*(w.url(model="m") for w in workers), **LORA) as gw,
    ):
        error = await call(gw, "r", "nope")
        assert error is not None and error.code() is grpc.StatusCode.NOT_FOUND
        _, details = rich_status(error)
        assert details["ErrorInfo"].reason == "ADAPTER_NOT_FOUND"
        assert "nope" in (error.details() or "")
        assert loads(gw) == 0


async def test_concurrent_calls_for_one_adapter_share_one_load() -> None:
    flags = ("--max-loras", "2", "--lora-load-ms", "200")
    async with (
        sims([flags] * 4) as workers,
        gateway(*(w.url(model="m") for w in workers), **LORA) as gw,
    ):
        results = await asyncio.gather(*(call(gw, f"r{i}", "a0") for i in range(8)))
        assert results == [None] * 8
        assert loads(gw) == 1
        assert [w.name for w in workers if "a0" in worker(gw, w).loras] != []


async def test_an_adapter_loaded_elsewhere_is_polled_and_served_where_it_is() -> None:
    """Only the configured adapters are kept of a worker's list (`lora.adapters`)."""
    adapter = ADAPTERS[0]
    async with (
        sims([SIM_FLAGS] * 3) as workers,
        gateway(*(w.url(model="m") for w in workers), **POLLED) as gw,
    ):
        async with grpc.aio.insecure_channel(workers[1].address) as ch:  # not via the gateway
            for name in ("ext", adapter):
                reply = await sgl_grpc.SglangSchedulerStub(ch).LoadLoRAAdapter(
                    sgl_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path="/x", lora_id=name)
                )
                assert reply.success
        await until(lambda: worker(gw, workers[1]).loras == (adapter,))
        results = await asyncio.gather(*(call(gw, f"r{i}", adapter) for i in range(6)))
        assert results == [None] * 6  # only w1 holds it: no load anywhere
        assert loads(gw) == 0


async def test_the_admin_api_lists_each_workers_adapters_and_the_bound_sessions() -> None:
    """ListWorkers names the adapters each worker holds (and the CLI's table has them);
    with session affinity on, how many sessions are bound."""
    from gateway.admin.text import format_table
    from gateway.admin.v1 import admin_pb2 as admin_pb
    from gateway.admin.v1 import admin_pb2_grpc

    settings = {**LORA, "affinity": {"header": "x-session-id"}}
    async with (
        sims([SIM_FLAGS] * 2) as workers,
        gateway(*(w.url(model="m") for w in workers), **settings) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i, adapter in enumerate(ADAPTERS[:2]):
            metadata = model_md("m", ("x-session-id", f"s{i}"))
            _, error = await collect(stub.Generate(lora_call(f"r{i}", adapter), metadata=metadata))
            assert error is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.admin_port}") as admin_ch:
            listed = await admin_pb2_grpc.AdminServiceStub(admin_ch).ListWorkers(
                admin_pb.ListWorkersRequest()
            )
    held = sorted(a for w in listed.workers for a in w.lora_adapters)
    assert held == sorted(ADAPTERS[:2])
    for w in listed.workers:
        assert set(w.lora_adapters) == set(worker(gw, next(
            s for s in workers if s.address == w.id)).loras)  # fmt: skip
    assert listed.sessions == 2
    table = format_table(list(listed.workers))
    assert "LORA" in table.splitlines()[0] and all(a in table for a in ADAPTERS[:2])


# -- workers that send too much ----------------------------------------------------------


def load_rejected(gw: Gateway, address: str) -> float:
    labels = {"worker": address}
    value = gw.parts.metrics.prometheus.get_sample_value(
        "gateway_worker_load_rejected_total", labels
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("configured", "kept"),
    [({}, tuple(f"a{i}" for i in range(8))), ({"a1": "/a1", "a5": "/a5"}, ("a1", "a5"))],
    ids=["any", "configured"],
)
async def test_a_worker_listing_200000_adapters_is_read_up_to_the_cap(
    configured: dict[str, str], kept: tuple[str, ...]
) -> None:
    """The list is cut after `lora.max_listed_per_worker` (counted as a rejected load
    figure); with `lora.adapters`, only those are kept of it."""
    settings: dict[str, Any] = {
        "loads.interval_s": 0.05,
        "lora.max_listed_per_worker": 8,
        "lora.adapters": configured,
    }
    async with (
        hostile(Hostile(adapters=200_000)) as bad,
        gateway(bad.url(), **settings) as gw,
    ):
        gw.parts.fleet.lora_watch.seen()  # a call named an adapter (else `lora.adapters` did)
        held = gw.parts.fleet.registry.get(bad.address)
        assert held is not None
        await until(lambda: held.loras == kept and held.loras_rejected >= 2)
        assert load_rejected(gw, bad.address) >= 2
        assert sorted(held.loras) == sorted(kept)


async def test_a_load_that_timed_out_waits_there_longer_each_time() -> None:
    """A worker that holds its loads: three calls share one load, which times out: one
    failure for its outlier detection, and the next call is refused at once without a
    load (no timeout); once the wait is over the load is tried again, and its next wait
    is twice as long."""
    settings: dict[str, Any] = {"lora.adapters": {"x": "/x"}, "lora.load_timeout_s": 0.2}
    async with (
        hostile(Hostile(hold_loads=True)) as bad,
        gateway(bad.url(), **settings) as gw,
    ):
        assert gw.parts.loras is not None
        held = gw.parts.fleet.registry.get(bad.address)
        assert held is not None
        errors = await asyncio.gather(*(call(gw, f"r{i}", "x") for i in range(3)))
        assert all(e is not None for e in errors)
        assert len(bad.loads) == 1 and held.outlier.failures == 1
        [(timeouts, _)] = gw.parts.loras.timed_out.values()
        assert timeouts == 1
        error = await call(gw, "r3", "x")
        assert error is not None and "its last load timed out" in (error.details() or "")
        assert len(bad.loads) == 1 and held.outlier.failures == 1  # refused without a load
        gw.parts.loras.timed_out[(bad.address, "x")] = (1, time.monotonic())  # its wait over
        assert await call(gw, "r4", "x") is not None
        assert len(bad.loads) == 2 and held.outlier.failures == 2
        [(timeouts, _)] = gw.parts.loras.timed_out.values()
        assert timeouts == 2  # waits load_backoff_s(2): twice the first
        await idle(gw)
        assert held.lora_calls == {} and not gw.parts.loras._pending
