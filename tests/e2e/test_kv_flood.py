"""Issue 14, item 4: one worker's KV events must not harm the whole gateway.

A hostile worker (sim/gateway_sim/kv_flood.py, its own process) floods the gateway's
subscription in turn with stored blocks, a snapshot batch far over `kv.max_event_bytes`,
a block size per rank, a dp rank per batch, and load figures out of range (GetLoads
answers about 3 x 2**32 running and NaN usage throughout). Meanwhile a client calls
another, well-behaved simulated model through the gateway. After each flood (a marker
load record tells the test the gateway applied everything before it), the test asserts
that admin ListWorkers answers with sane numbers; at the end, that the gateway's peak
RSS stayed under the bound, that the small calls stayed within 100 ms of their
unloaded latency (the timing tier; else within ten times it plus a second: a machine
busy with other work stretches the flood's indexing to stalls of some 0.7 s), and that
/metrics shows no NaN.

Scaled down from the issue's numbers where the cap makes the same point (a run of 30 s
took most of it indexing blocks, at some 26,000 a second): the per-worker block cap is
set to 25,000 (`kv.max_blocks_per_worker`, default 250,000) and the flood is 50,000
stored blocks instead of 2M (2x the cap: the flood still ends at the cap, the evictions
it causes are the same per block, and ListWorkers must show the index at the cap or
under); 2,000 dp ranks instead of 127k (the cap is 256: every rank past it is refused
alike, 1,744 of them); the snapshot batch is the issue's 1M blocks (32 MB, refused
unread: were it read and indexed, the gateway would grow by ~200 MB, far past the RSS
bound), and 2,000 block sizes as in the issue. The RSS bound is the capped index plus
the same 96 MiB of buffers and slack; the stall bound is the issue's 100 ms.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_sim.client import (
    admin_address,
    channel,
    list_workers,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health,
    write_config,
)
from gateway_sim.kv_flood import KvFlooder
from gateway_sim.launch import Child, worker_url
from tests.support.availability import samples, scrape
from tests.support.launch import Launcher
from tests.support.serial import run_alone

# The small calls' latency is measured: the good worker is a process of its own.
pytestmark = [pytest.mark.timeout(240), pytest.mark.sim_processes]

ROOT = Path(__file__).resolve().parents[2]
INDEX_BYTES_PER_BLOCK = 200  # measured: ~200 B per stored block (scripts/bench/bench_prefix.py)
CAP_BLOCKS = 25_000  # kv.max_blocks_per_worker, set by the test (default 250,000)
# The index at its cap, plus grpc's buffers for a few 4 MiB messages and allocator slack.
RSS_GROWTH_BOUND = CAP_BLOCKS * INDEX_BYTES_PER_BLOCK + 96 * 1024 * 1024
STALL_BOUND_S = 0.100  # the timing tier's; `make test` allows STALL_FACTOR x unloaded + 1 s
STALL_FACTOR = 10
MARKER_WITHIN_S = 60.0  # a safety net: some 5 s a flood idle, 20 s on a busy machine


def rss_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


@pytest.fixture
def hostile() -> Iterator[KvFlooder]:
    worker = KvFlooder()
    yield worker
    worker.stop()


class Caller:
    """Small calls to the well-behaved model, one after another, timed."""

    def __init__(self, gw: Child) -> None:
        self.gw = gw
        self.latencies: list[float] = []
        self.phase = ""
        self.worst: dict[str, float] = {}
        self.running = False

    async def one(self, stub: sgl_grpc.SglangSchedulerStub, n: int) -> float:
        start = time.perf_counter()
        request = sgl_generate(f"small-{n}", tokens=2, stream=False)
        await stub.Generate(request, metadata=model_md("good"), timeout=10).read()
        return time.perf_counter() - start

    async def baseline(self, count: int = 30) -> float:
        async with channel(self.gw.address) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            times = [await self.one(stub, n) for n in range(count)]
        return statistics.median(times[5:])

    async def loop(self) -> None:
        async with channel(self.gw.address) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            n = 0
            while self.running:
                took = await self.one(stub, n)
                self.latencies.append(took)
                self.worst[self.phase] = max(self.worst.get(self.phase, 0.0), took)
                n += 1
                await asyncio.sleep(0.01)


async def until_marker(gw: Child, worker_id: str, marker: int, within_s: float) -> float:
    """Poll ListWorkers until the hostile worker's load shows the marker; every answer
    must come back (and within its deadline). Returns the slowest answer's time."""
    slowest = 0.0
    deadline = time.monotonic() + within_s
    while True:
        start = time.perf_counter()
        workers = await list_workers(admin_address(gw))
        slowest = max(slowest, time.perf_counter() - start)
        load = workers[worker_id].load
        assert 0 <= load.token_usage <= 1  # never NaN
        if load.running == marker:
            return slowest
        assert time.monotonic() < deadline, f"marker {marker} not seen: {workers[worker_id]}"
        await asyncio.sleep(0.1)


async def test_a_flooding_worker_costs_the_gateway_bounded_memory_and_no_stall(
    gateway: Launcher, sim: Launcher, hostile: KvFlooder, tmp_path: Path, strict: bool
) -> None:
    good = sim("--runtime", "sglang", "--model", "good", "--name", "good-0")
    evil = f"grpc://127.0.0.1:{hostile.port}?model=evil&runtime=sglang"
    config = write_config(tmp_path, {"kv": {"max_blocks_per_worker": CAP_BLOCKS}})
    gw = gateway(
        "--config",
        config,
        "--worker",
        worker_url(good, model="good", runtime="sglang"),
        "--worker",
        evil,
    )
    await wait_health(gw.address, "good")
    await wait_health(gw.address, "evil")
    run_alone()
    evil_id = f"127.0.0.1:{hostile.port}"
    pid = gw.process.pid
    caller = Caller(gw)
    unloaded = await caller.baseline()
    await hostile.flood("marker 1")
    admin_unloaded = await until_marker(gw, evil_id, 1, MARKER_WITHIN_S)
    rss_before = rss_kb(pid, "VmRSS") * 1024

    caller.running = True
    calls = asyncio.create_task(caller.loop())
    slowest_admin = 0.0
    floods = ["blocks 50000", "snapshot 1000000", "sizes 2000", "ranks 2000", "loads"]
    started = time.monotonic()
    for marker, command in enumerate(floods, start=2):
        caller.phase = command
        await hostile.flood(command)
        await hostile.flood(f"marker {marker}")
        slowest = await until_marker(gw, evil_id, marker, MARKER_WITHIN_S)
        slowest_admin = max(slowest_admin, slowest)
        workers = await list_workers(admin_address(gw))
        assert workers[evil_id].kv_index.blocks <= CAP_BLOCKS
        if command.startswith("blocks"):  # the flood filled the index: it stops at the cap
            assert workers[evil_id].kv_index.blocks == CAP_BLOCKS
    flood_s = time.monotonic() - started
    caller.running = False
    await calls

    peak = rss_kb(pid, "VmHWM") * 1024
    text = scrape(gw)
    events = {
        dict(labels)["kind"]: value
        for labels, value in samples(text, "gateway_kv_events_total").items()
        if dict(labels)["worker"] == evil_id
    }
    resyncs = samples(text, "gateway_kv_resyncs_total")
    rejected = samples(text, "gateway_worker_load_rejected_total")
    during = sorted(caller.latencies)
    p90 = during[int(len(during) * 0.9)]
    p99 = during[int(len(during) * 0.99)]
    print(
        f"\nflood {flood_s:.1f} s; small call unloaded {unloaded * 1000:.1f} ms, during "
        f"p50 {statistics.median(during) * 1000:.1f} p90 {p90 * 1000:.1f} p99 {p99 * 1000:.1f} "
        f"max {during[-1] * 1000:.1f} ms ({len(during)} calls); RSS before "
        f"{rss_before / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; slowest admin answer "
        f"{slowest_admin * 1000:.0f} ms; events {events}; resyncs {resyncs}; worst call by "
        f"flood {caller.worst}"
    )
    assert peak - rss_before < RSS_GROWTH_BOUND
    if strict:
        assert p99 <= unloaded + STALL_BOUND_S  # the max is printed; it was within, too
        assert slowest_admin < 2.0
    else:
        assert p99 <= STALL_FACTOR * unloaded + 1.0
        assert slowest_admin < STALL_FACTOR * admin_unloaded + 2.0
    assert events.get("rejected_rank", 0) >= 2_000 - 256
    assert events.get("rejected_block_size", 0) > 0
    assert events.get("rejected_load", 0) >= 2
    assert any(dict(k)["reason"] == "too_large" for k in resyncs)
    assert sum(v for k, v in rejected.items() if dict(k)["worker"] == evil_id) > 0
    assert not [line for line in text.splitlines() if line.endswith("NaN")]
    # The good model still serves, as fast as before.
    after = await caller.baseline(count=6)
    assert after < (unloaded + STALL_BOUND_S if strict else STALL_FACTOR * unloaded + 1.0)
