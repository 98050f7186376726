"""In-process parts: simulated workers and the gateway on ephemeral ports, in the test's
own event loop, so a test can look at the gateway's state (in-flight counts, the abort
table, outlier detectors) between two steps of a call, deterministically."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from grpc import aio

from gateway.app.reload import Reread
from gateway.app.server import Gateway
from gateway.config import AdminConfig, build_config
from gateway.observability.record import CallRecord
from gateway.scale.member import Member
from gateway.upstream.worker import Worker, WorkerStatus
from gateway_sim.config import SimConfig
from gateway_sim.flags import add_sim_arguments
from gateway_sim.server import serve
from tests.support.waits import until


@dataclass(frozen=True)
class Sim:
    port: int
    side: Mapping[str, int]
    name: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, **query: Any) -> str:
        return f"grpc://{self.address}?" + "&".join(f"{k}={v}" for k, v in query.items())


@contextlib.asynccontextmanager
async def sim(*flags: str) -> AsyncIterator[Sim]:
    """A simulated worker served in this event loop until the block ends."""
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    config = SimConfig.from_args(parser.parse_args(["--listen", "127.0.0.1:0", *flags]))
    ready: asyncio.Future[tuple[int, dict[str, int]]] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(config, ready=lambda port, side: ready.set_result((port, dict(side))))
    )
    try:
        started: set[asyncio.Future[Any]] = {task, ready}
        await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            task.result()  # raises why it did not start
        port, side = ready.result()
        yield Sim(port, side, config.worker_name(port))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await task


@contextlib.asynccontextmanager
async def gateway(
    *urls: str,
    member: Member | None = None,
    ready: bool = True,
    reread: Reread | None = None,
    **overrides: Any,
) -> AsyncIterator[Gateway]:
    """The gateway in this event loop, every worker ready before the block starts (unless
    `ready` is False: a worker that never answers); with `member`, one serving process of
    several (its own port here, so a test can pick it)."""
    config = build_config(
        worker_urls=urls,
        overrides={
            "listen": "127.0.0.1:0",
            "admin.listen": "127.0.0.1:0",
            "metrics.listen": "off",
            "probe.interval_s": 0.05,
            "probe.success_threshold": 1,
            **overrides,
        },
    )
    if member is not None:  # as the supervisor starts it
        config = replace(config, admin=AdminConfig(listen=member.control_address()))
    gw = Gateway(config, member, reread=reread)
    await gw.start()
    try:
        if ready:
            await until(
                lambda: all(w.status is WorkerStatus.READY for w in gw.parts.fleet.registry)
            )
        yield gw
    finally:
        await gw.close()


def worker(gw: Gateway, sim: Sim) -> Worker:
    found = gw.parts.fleet.registry.get(sim.address)
    assert found is not None
    return found


async def idle(gw: Gateway) -> None:
    """Every in-flight count back to zero and the abort table empty."""
    await until(
        lambda: all(w.inflight == 0 for w in gw.parts.fleet.registry) and not len(gw.parts.inflight)
    )


@contextlib.asynccontextmanager
async def client(gw: Gateway) -> AsyncIterator[aio.Channel]:
    async with aio.insecure_channel(f"127.0.0.1:{gw.port}") as channel:
        yield channel


def pd_urls(prefill: Sim, decode: Sim, runtime: str = "sglang", **extra: Any) -> list[str]:
    """Worker URLs for a prefill and a decode, roles and ports given explicitly."""
    prefill_query = {"model": "m", "runtime": runtime, "role": "prefill", **extra}
    if "bootstrap" in prefill.side:
        prefill_query["bootstrap_port"] = prefill.side["bootstrap"]
    return [prefill.url(**prefill_query), decode.url(model="m", runtime=runtime, role="decode")]


def recorded(gw: Gateway) -> list[CallRecord]:
    """The records of the calls that end from now on (as the metrics see them)."""
    records: list[CallRecord] = []
    for front in gw.parts.fronts:
        observe = front.call_log.observe

        def keep(record: CallRecord, observe: Any = observe) -> None:
            records.append(record)
            observe(record)

        front.call_log.observe = keep
    return records
