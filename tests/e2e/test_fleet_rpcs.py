"""Non-Generate RPCs and policies: Abort routing, fleet-wide facts,
the gateway's own HealthCheck, per-worker fan-out, load balancing and discovery.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from gateway_sim.client import (
    SGL_SERVICE,
    VLLM_SERVICE,
    channel,
    collect,
    is_healthy,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    vllm,
    vllm_generate,
    vllm_grpc,
    wait_health,
    wait_idle,
)
from gateway_sim.launch import Child, SharedProcesses, start_many, worker_url
from tests.support.helpers import ABORT_COMPLETES, assert_verdict, wait_for_events
from tests.support.launch import Launcher, SimHost

SLOW = ("x-sim-token-ms", "50")  # 100 tokens: 5 s unless aborted or cancelled
VOCAB = ("--vocab-size", "32000")  # the ids the simulated workers take


def urls(*children: Child, runtime: str = "sglang", model: str = "m") -> list[str]:
    args: list[str] = []
    for child in children:
        args += ["--worker", worker_url(child, model=model, runtime=runtime)]
    return args


@dataclass(frozen=True)
class Fleet:
    a: Child  # SGLang, model m, named a
    b: Child  # SGLang, model m, named b
    c: Child  # SGLang, model m, named c (not behind `gateway`)
    v: Child  # vLLM, model v, named v0
    gateway: Child  # round robin over a, b and v

    @property
    def log_path(self) -> Path:
        path: Path = self.gateway.log_path  # set by the `gateway` launcher
        return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, sim_host: SimHost) -> Iterator[Fleet]:
    """Workers shared by this module's tests (none of them kills or reconfigures one, and
    every test leaves them idle). Policy tests put their own gateway in front."""
    shared = SharedProcesses(tmp_path_factory.mktemp("fleet"), sim_host)
    try:
        a, b, c, v = shared.sims(
            ("--runtime", "sglang", "--model", "m", "--name", "a", *VOCAB),
            ("--runtime", "sglang", "--model", "m", "--name", "b", *VOCAB),
            ("--runtime", "sglang", "--model", "m", "--name", "c", *VOCAB),
            ("--runtime", "vllm", "--model", "v", "--name", "v0"),
        )
        gw = shared.gateway(*urls(a, b), *urls(v, runtime="vllm", model="v"))
        yield Fleet(a, b, c, v, gw)
    finally:
        shared.stop()


@pytest.fixture
async def ready(fleet: Fleet) -> Fleet:
    await wait_health(fleet.gateway.address, "m")
    await wait_health(fleet.gateway.address, "v", "vllm")
    return fleet


async def assert_idle(fleet: Fleet) -> None:
    for worker in (fleet.a, fleet.b, fleet.c):
        assert await wait_idle(worker.address) == 0
    assert await wait_idle(fleet.v.address, "vllm") == 0


async def test_sglang_abort_reaches_the_worker_holding_the_request(ready: Fleet) -> None:
    async with channel(ready.gateway.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        started = time.monotonic()
        call = stub.Generate(
            sgl_generate("long-1", tokens=100), metadata=model_md("m", SLOW, ABORT_COMPLETES)
        )
        first = await call.__aiter__().__anext__()
        assert first.HasField("chunk")

        reply = await stub.Abort(sgl.AbortRequest(request_id="long-1"), metadata=model_md("m"))
        assert reply.success is True

        rest, error = await collect(call)
        elapsed = time.monotonic() - started
        assert error is None
        assert rest[-1].complete.finish_reason == "abort"
        assert 1 + len(rest) < 101
        assert elapsed < 3.0

        unknown = await stub.Abort(sgl.AbortRequest(request_id="nope"), metadata=model_md("m"))
        assert unknown.success is False
        assert unknown.message == "request 'nope' is not in flight here"
    await assert_idle(ready)
    [found] = wait_for_events(ready.log_path, 1, "Abort", "long-1")
    assert (found["code"], found["attempts"], found["retries"]) == ("OK", 0, 0)
    [generate] = wait_for_events(ready.log_path, 1, "Generate", "long-1")
    assert found["targets"] == [generate["worker"]]  # the worker that held the request
    [not_found] = wait_for_events(ready.log_path, 1, "Abort", "nope")
    assert (not_found["code"], not_found["attempts"], not_found["targets"]) == ("OK", 0, None)


async def test_vllm_abort_by_request_ids(ready: Fleet) -> None:
    async with channel(ready.gateway.address) as ch:
        stub = vllm_grpc.VllmEngineStub(ch)
        call = stub.Generate(vllm_generate("v-long", tokens=100), metadata=model_md("v", SLOW))
        await call.__aiter__().__anext__()
        reply = await stub.Abort(vllm.AbortRequest(request_ids=["v-long"]), metadata=model_md("v"))
        assert reply == vllm.AbortResponse()
        rest, error = await asyncio.wait_for(collect(call), 3)
        assert error is None
        assert rest[-1].complete.finish_reason == "abort"
        # Ids the gateway does not know: an empty answer, never an error.
        ids = vllm.AbortRequest(request_ids=["x", "y"])
        assert await stub.Abort(ids, metadata=model_md("v")) == vllm.AbortResponse()
    await assert_idle(ready)


async def test_fleet_wide_rpcs_are_forwarded(ready: Fleet) -> None:
    async with channel(ready.gateway.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        info = await stub.GetModelInfo(sgl.GetModelInfoRequest(), metadata=model_md("m"))
        # (SGLang's servicer reports its default vocabulary whatever the model, as here)
        assert (info.served_model_name, info.model_path, info.vocab_size) == ("m", "sim/m", 128_256)
        server = await stub.GetServerInfo(sgl.GetServerInfoRequest(), metadata=model_md("m"))
        assert server.server_args["served_model_name"] == "m"
        assert server.server_type == "grpc"
        chunks, error = await collect(
            stub.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=model_md("m"))
        )
        assert error is None
        assert len(chunks) == 2
        assert chunks[0].data.startswith(b"sim-tokenizer:m:")
        assert chunks[0].sha256 == ""
        assert len(chunks[1].sha256) == 64

        vstub = vllm_grpc.VllmEngineStub(ch)
        vinfo = await vstub.GetModelInfo(vllm.GetModelInfoRequest(), metadata=model_md("v"))
        assert vinfo.served_model_name == "v"
        vserver = await vstub.GetServerInfo(vllm.GetServerInfoRequest(), metadata=model_md("v"))
        assert (vserver.server_type, vserver.block_size) == ("", 128)  # vLLM's answer
        # A named worker (x-target-worker) answers a fleet-wide RPC when it is available.
        for _ in range(2):
            pinned = await stub.GetServerInfo(
                sgl.GetServerInfoRequest(),
                metadata=model_md("m", ("x-target-worker", ready.b.address)),
            )
            assert pinned.server_args["served_model_name"] == "m"
    pinned_events = wait_for_events(ready.log_path, 4, "GetServerInfo")[-2:]
    assert [e["worker"] for e in pinned_events] == [ready.b.address] * 2
    forwarded = [
        *wait_for_events(ready.log_path, 2, "GetModelInfo"),
        *wait_for_events(ready.log_path, 4, "GetServerInfo"),
        *wait_for_events(ready.log_path, 1, "GetTokenizer"),
    ]
    assert len(forwarded) == 7
    assert all(e["attempts"] == 1 and e["code"] == "OK" for e in forwarded)
    assert {e["worker"] for e in forwarded if e["model"] == "v"} == {ready.v.address}


async def test_get_loads_and_flush_cache_fan_out_to_every_worker(ready: Fleet) -> None:
    a, b = ready.a, ready.b
    async with channel(ready.gateway.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        # One request running somewhere shows up in the merged loads.
        running = stub.Generate(sgl_generate("busy", tokens=100), metadata=model_md("m", SLOW))
        await running.__aiter__().__anext__()

        call = stub.GetLoads(sgl.GetLoadsRequest(), metadata=model_md("m"))
        loads = await call
        assert len(loads.loads) == 2
        assert loads.dp_rank_count == 2
        assert sorted(load.num_running_reqs for load in loads.loads) == [0, 1]
        workers = dict(await call.initial_metadata())["x-gateway-workers"]
        assert sorted(workers.split(",")) == sorted([a.address, b.address])

        flushed = await stub.FlushCache(common_pb2.FlushCacheRequest(), metadata=model_md("m"))
        assert flushed.success is True
        assert sorted(flushed.message.split("; ")) == ["cache flushed on a", "cache flushed on b"]
        running.cancel()
    await assert_idle(ready)


@pytest.mark.sim_processes  # its workers are killed
async def test_engine_health_check_is_answered_by_the_gateway(
    sim: Launcher, gateway: Launcher
) -> None:
    a, b = start_many(sim, ("--model", "m"), ("--model", "m"))
    gw = gateway(*urls(a, b))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        reply = await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=model_md("m"))
        assert (reply.healthy, reply.message) == (True, "model 'm' is servable")
        a.kill()
        b.kill()
        await wait_health(gw.address, "m", healthy=False)
        reply = await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=model_md("m"))
        assert (reply.healthy, reply.message) == (False, "model 'm' has no available workers")
    checks = wait_for_events(gw.log_path, 2, rpc="HealthCheck")
    assert all(e["attempts"] == 0 and e["worker"] is None for e in checks)  # no worker asked


async def test_round_robin_alternates(ready: Fleet, gateway: Launcher) -> None:
    gw = gateway("--policy", "round_robin", *urls(ready.a, ready.b))
    await wait_health(gw.address, "m")
    order = []
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(6):
            call = stub.Generate(sgl_generate(f"r{i}", tokens=1), metadata=model_md("m"))
            _, error = await collect(call)
            assert error is None
            order.append(dict(await call.initial_metadata())["x-sim-worker"])
    assert order in (["a", "b"] * 3, ["b", "a"] * 3)


async def test_consistent_hash_keeps_a_key_on_its_worker(ready: Fleet, gateway: Launcher) -> None:
    gw = gateway("--policy", "consistent_hash", *urls(ready.a, ready.b, ready.c))
    await wait_health(gw.address, "m")
    placed: dict[str, set[str]] = {}
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for _ in range(2):
            for k in range(12):
                key = f"user-{k}"
                call = stub.Generate(
                    sgl_generate(key, tokens=1), metadata=model_md("m", ("x-routing-key", key))
                )
                _, error = await collect(call)
                assert error is None
                worker = dict(await call.initial_metadata())["x-sim-worker"]
                placed.setdefault(key, set()).add(worker)
    assert all(len(names) == 1 for names in placed.values()), placed
    assert len(set().union(*placed.values())) >= 2  # keys spread over the fleet


@pytest.mark.parametrize("policy", ["power_of_two", "least_inflight"])
async def test_load_aware_policies_avoid_the_busy_worker(
    ready: Fleet, gateway: Launcher, policy: str
) -> None:
    gw = gateway("--policy", policy, *urls(ready.a, ready.b))
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        busy_call = stub.Generate(sgl_generate("busy", tokens=100), metadata=model_md("m", SLOW))
        busy = dict(await busy_call.initial_metadata())["x-sim-worker"]
        for i in range(4):
            call = stub.Generate(sgl_generate(f"r{i}", tokens=2), metadata=model_md("m"))
            messages, error = await collect(call)
            assert error is None
            assert len(messages) == 3
            assert dict(await call.initial_metadata())["x-sim-worker"] != busy
        busy_call.cancel()
    await assert_idle(ready)


async def test_workers_without_model_or_runtime_are_discovered(
    ready: Fleet, gateway: Launcher
) -> None:
    gw = gateway("--worker", worker_url(ready.a), "--worker", worker_url(ready.v))
    await wait_health(gw.address, "m")
    await wait_health(gw.address, "v", "vllm")
    async with channel(gw.address) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate(tokens=2), metadata=model_md("m")
        )
        messages, error = await collect(call)
        assert error is None
        assert len(messages) == 3
        assert dict(await call.initial_metadata())["x-sim-worker"] == "a"

        vcall = vllm_grpc.VllmEngineStub(ch).Generate(
            vllm_generate(tokens=2), metadata=model_md("v")
        )
        messages, error = await collect(vcall)
        assert error is None
        assert len(messages) == 3
        assert dict(await vcall.initial_metadata())["x-sim-worker"] == "v0"

        # Each model was registered on its own protocol only.
        _, wrong = await collect(
            sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("v"))
        )
    assert wrong is not None
    assert_verdict(
        wrong,
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
        f"Model 'v' is not served over {SGL_SERVICE}; it is served over {VLLM_SERVICE}",
        {"model": "v", "leg": "", "httpStatus": "404", "code": "model_not_found"},
    )
    assert await is_healthy(gw.address, "m")
