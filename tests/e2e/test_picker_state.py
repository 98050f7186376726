"""The gateway as Envoy's endpoint picker (real processes: simulated workers, `gateway
serve --picker-listen`, Envoy), and what it keeps across calls: a worker killed mid-stream
counts against it; nothing is left reserved after calls the clients cancel; an abort
reaches the worker the picker placed the stream on; cache-aware routing hits as much
through Envoy as through the relay; the serving processes share the picker port; flow
control queues calls in the picker."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    generate_for,
    model_md,
    pb_for,
    sgl_generate,
    sgl_grpc,
    stub_for,
    wait_health,
    write_config,
)
from gateway_sim.envoy import envoy_binary
from gateway_sim.launch import Child, start_many, worker_url
from tests.support.helpers import assert_verdict
from tests.support.launch import Launcher
from tests.support.picker import MODES, picker_gateway, with_envoy
from tests.support.processes import scrape
from tests.support.waits import until

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary")

WAIT_S = 20.0
HOLD = ("x-sim-ttft-ms", "30000")  # a call that holds its worker's slot until cancelled
CLIENTS = 16
SLOTS = 2 * CLIENTS


@pytest.mark.sim_processes  # the worker exits mid-stream
@pytest.mark.parametrize("mode", list(MODES))
async def test_a_worker_killed_mid_stream_counts_against_it(
    mode: str, sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """The stream breaks after the worker's headers, with no status (Envoy resets the
    client's stream): the picker's check finds the worker gone, and outlier detection
    (one failure ejects) ejects it, where a client's own cancel ejects nothing."""
    doomed = sim("--model", "m", "--tokens", "50", "--token-ms", "5", "--exit-after", "5")
    steady = sim("--model", "s", "--tokens", "200", "--token-ms", "5")
    config = write_config(
        tmp_path, {"outlier_detection": {"failure_threshold": 1, "cooldown_s": 60}}
    )
    gw = picker_gateway(
        gateway,
        "--config",
        config,
        "--worker",
        worker_url(doomed, model="m", runtime="sglang"),
        "--worker",
        worker_url(steady, model="s", runtime="sglang"),
    )
    envoy = with_envoy(gw, processes, tmp_path, MODES[mode])
    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        # A client that leaves mid-stream: nothing against the worker.
        call = stub.Generate(sgl_generate("c", tokens=200), metadata=model_md("s"))
        async for _ in call:
            break
        call.cancel()
        messages, error = await collect(
            stub.Generate(sgl_generate("k", tokens=50), metadata=model_md("m"))
        )
    assert error is not None and 0 < len(messages) < 51
    ejected = f'gateway_worker_outlier{{state="open",worker="{doomed.address}"}}'
    steady_ejected = f'gateway_worker_outlier{{state="open",worker="{steady.address}"}}'
    for _ in range(round(WAIT_S / 0.05)):
        samples = scrape(gw)
        if samples.get(ejected) == 1:
            break
        await asyncio.sleep(0.05)
    assert samples.get(ejected) == 1
    assert samples.get(steady_ejected) == 0
    assert samples[f'gateway_worker_inflight{{worker="{steady.address}"}}'] == 0


@pytest.mark.parametrize("mode", list(MODES))
async def test_nothing_is_left_reserved_after_calls_clients_cancel(
    mode: str, sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """1,000 calls through Envoy, a random part of them cancelled by their clients at a
    random point (before the answer, mid-stream): every reservation, in-flight count
    and admission slot comes back."""
    workers = start_many(sim, *(("--model", "m", "--tokens", "8", "--token-ms", "1"),) * 2)
    # Twice as many admission slots as clients (a cancelled call's slot comes back once
    # Envoy's reset reaches the picker, maybe after its client's next call has begun): at
    # the end, a slot not given back refuses one of as many calls as there are slots.
    config = write_config(
        tmp_path,
        {"limits": {"max_inflight_requests": SLOTS, "max_inflight_per_principal": SLOTS}},
    )
    urls = [a for w in workers for a in ("--worker", worker_url(w, model="m", runtime="sglang"))]
    gw = picker_gateway(gateway, "--config", config, *urls)
    envoy = with_envoy(gw, processes, tmp_path, MODES[mode])
    rng = random.Random(29)
    plan = [rng.choice((None, 0, 1, 4)) for _ in range(1000)]  # cancel after k messages
    ok = cancelled = 0

    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        queue = list(enumerate(plan))

        async def client() -> None:
            nonlocal ok, cancelled
            while queue:
                i, after = queue.pop()
                call = stub.Generate(sgl_generate(f"c{i}", tokens=8), metadata=model_md("m"))
                if after == 0:
                    await asyncio.sleep(0)
                    call.cancel()
                    cancelled += 1
                    continue
                read = 0
                try:
                    async for _ in call:
                        read += 1
                        if after is not None and read == after:
                            call.cancel()
                            break
                except aio.AioRpcError as error:
                    assert error.code() is grpc.StatusCode.CANCELLED
                if after is None:
                    ok += 1
                else:
                    cancelled += 1

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        assert ok + cancelled == 1000 and ok > 100
        inflight = [f'gateway_worker_inflight{{worker="{w.address}"}}' for w in workers]
        for _ in range(round(WAIT_S / 0.05)):
            samples = scrape(gw)
            if all(samples[k] == 0 for k in inflight):
                break
            await asyncio.sleep(0.05)
        assert [samples[k] for k in inflight] == [0, 0]
        # Every admission slot is back: as many calls as there are slots all go through.
        calls = [stub.Generate(sgl_generate(f"a{i}"), metadata=model_md("m")) for i in range(SLOTS)]
        results = await asyncio.gather(*(collect(call) for call in calls))
        assert [error for _, error in results] == [None] * SLOTS
    samples = scrape(gw)
    for worker in workers:  # a client's cancel says nothing against its worker
        assert samples[f'gateway_worker_outlier{{state="open",worker="{worker.address}"}}'] == 0


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
async def test_abort_reaches_the_worker_the_picker_placed_the_stream_on(
    sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path, runtime: str
) -> None:
    """A stream the picker placed, then its Abort through Envoy: sent straight to that
    worker (the picker's in-flight table), which stops the stream."""
    # (--abort-completes: an aborted SGLang stream ends, which a real SGLang worker's does not)
    worker = sim(
        "--runtime", runtime, "--model", "m", "--tokens", "2000", "--token-ms", "5",
        "--abort-completes",
    )  # fmt: skip
    gw = picker_gateway(gateway, "--worker", worker_url(worker, model="m", runtime=runtime))
    envoy = with_envoy(gw, processes, tmp_path)
    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        stub = stub_for(ch, runtime)
        call = stub.Generate(generate_for(runtime, "long", tokens=2000), metadata=model_md("m"))
        async for _ in call:
            break
        pb = pb_for(runtime)
        abort = (
            pb.AbortRequest(request_ids=["long"])
            if runtime == "vllm"
            else pb.AbortRequest(request_id="long")
        )
        await stub.Abort(abort, metadata=model_md("m"))
        messages, _ = await collect(call)
    assert len(messages) < 1999  # the worker stopped it
    assert scrape(gw)['gateway_picker_answers_total{answer="worker"}'] == 2  # the stream, the abort


async def queued_calls(gw: Child, count: int) -> bool:
    """Whether `count` calls wait in the gateway's queues (admin ListQueues)."""
    async with aio.insecure_channel(admin_address(gw)) as ch:
        listed = await admin_pb2_grpc.AdminServiceStub(ch).ListQueues(
            admin_pb.ListQueuesRequest(), timeout=2
        )
    waiting: int = sum(q.waiting for q in listed.queues)
    return waiting == count


def bench_routing() -> Any:
    """scripts/bench/bench_routing.py, for its trace and its runs."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_routing.py"
    spec = importlib.util.spec_from_file_location("bench_routing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_routing", module)  # its dataclasses look themselves up
    spec.loader.exec_module(sys.modules["bench_routing"])
    return sys.modules["bench_routing"]


async def test_cache_aware_hits_as_much_through_envoy_as_through_the_relay() -> None:
    """The routing benchmark's multi-turn trace (smaller), sent through the relay and
    through Envoy + picker with cache_aware: the workers' own hit rates agree within 10
    points (the same placement rules on the same index)."""
    bench = bench_routing()
    args = argparse.Namespace(
        workers=4, tenants=8, sessions=16, turns=4, system_tokens=512, turn_tokens=64,
        block_size=16, kv_blocks=256, prefill_us_per_token=100.0, ttft_ms=2.0, rate=20.0,
        seed=1, drop_rate=0.0, restart=False,
    )  # fmt: skip
    # 20 calls/s, not the benchmark's 40: on a busy machine the slower mode would lag its
    # workers' KV events, and the hit rates would differ by timing, not by placement.
    trace = bench.make_trace(args)
    relay = await bench.run_policy(args, "cache_aware", True, trace)
    picked = await bench.run_policy(args, "cache_aware", True, trace, picker=True)
    assert relay.failures == picked.failures == 0
    assert relay.hit_rate > 0.5
    # At least as much, within 10 points: ties go to the prompt's own rendezvous order
    # (alike on every gateway), but where the balance guard steps in follows each mode's
    # timing (measured 2-7 points either way on a busy machine, so 5 was too tight). A
    # picker that placed otherwise (an index it does not teach) falls far below: 0.3 or
    # so. One-sided, as the test's name says.
    assert picked.hit_rate >= relay.hit_rate - 0.10


async def test_serving_processes_share_the_picker_port(
    sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """`--processes 2`: the supervisor holds the picker's port as it holds the main
    port; Envoy's streams to it are spread over both processes, and every call works."""
    worker = sim("--model", "m")
    gw = picker_gateway(
        gateway, "--processes", "2", "--worker", worker_url(worker, model="m", runtime="sglang")
    )
    await wait_health(gw.address, "m")
    envoy = with_envoy(gw, processes, tmp_path)
    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        results = await asyncio.gather(
            *(
                collect(stub.Generate(sgl_generate(f"p{i}"), metadata=model_md("m")))
                for i in range(20)
            )
        )
    assert [(len(m), e) for m, e in results] == [(5, None)] * 20
    assert scrape(gw)['gateway_picker_answers_total{answer="worker"}'] == 20


async def test_flow_control_queues_calls_in_the_picker(
    sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """One slot, one place in the queue, every call through Envoy: the second waits in
    the picker (before Envoy hears where it goes), the third is QUEUE_FULL as the relay
    says it, and once the first call's client leaves, the waiting call is served."""
    worker = sim("--model", "m", "--headers-first")  # a held call shows by its headers
    settings = {"models": {"m": {"max_inflight": 1}}, "flow": {"queue": {"max_requests": 1}}}
    url = worker_url(worker, model="m", runtime="sglang")
    gw = picker_gateway(gateway, "--config", write_config(tmp_path, settings), "--worker", url)
    await wait_health(gw.address, "m")
    envoy = with_envoy(gw, processes, tmp_path)
    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = stub.Generate(sgl_generate("held"), metadata=model_md("m", HOLD), timeout=60)
        await held.initial_metadata()  # the worker runs it
        queued = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("queued"), metadata=model_md("m"), timeout=20))
        )
        await until(lambda: queued_calls(gw, 1), what="1 call waiting")
        messages, error = await collect(
            stub.Generate(sgl_generate("third"), metadata=model_md("m"), timeout=20)
        )
        assert messages == [] and error is not None
        assert_verdict(
            error,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "QUEUE_FULL",
            "Every worker for model 'm' is busy and its queue is full "
            "(1 waiting, flow.queue.max_requests 1)",
            {"model": "m", "leg": "", "httpStatus": "429", "code": "queue_full"},
            retry_s=1,
            pushback_ms=1000,
        )
        assert not queued.done()
        held.cancel()
        messages, error = await queued
    assert error is None and len(messages) == 5
