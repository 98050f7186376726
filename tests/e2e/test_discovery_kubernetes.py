"""Kubernetes discovery end to end: the stand-in API server (tests/support/fakes/apiserver.py, in a
thread of the test process), `gateway serve` as a real process with a `discovery:`
kubernetes entry whose kubeconfig names the stand-in, and simulated workers on 127.0.0.2
and 127.0.0.3, the IPs of their Pods. A Pod gets calls only while Ready; prefill and
decode Pods found by two selectors make SGLang PD pairs, the prefill's bootstrap port
taken from an annotation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    list_workers,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health,
    write_config,
)
from gateway_sim.launch import Child
from tests.support.availability import is_ready, wait_worker
from tests.support.fakes.apiserver import InThread
from tests.support.launch import Launcher
from tests.support.processes import per_process
from tests.support.waits import WAIT_S

NS = "llm"
A, B = "127.0.0.2", "127.0.0.3"
GRACE_S = 3.0  # unready_grace_s: out of service this long, a Pod's worker leaves
BOOTSTRAP = "sglang.example/bootstrap-port"


@pytest.fixture
def kube() -> Iterator[InThread]:
    server = InThread(token="e2e-token")
    try:
        yield server
    finally:
        server.close()


def serve(
    gateway: Launcher,
    tmp_path: Path,
    kube: InThread,
    *entries: dict[str, Any],
    args: tuple[str, ...] = (),
) -> Child:
    kubeconfig = kube.server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    common = {
        "source": "kubernetes",
        "kubeconfig": str(kubeconfig),
        "port": "grpc",
        "model": "m",
        "runtime": "sglang",
    }
    config = {
        "discovery": [{**common, **entry} for entry in entries],
        # manual: round robin unless a call names its worker (x-target-worker)
        "models": {"m": {"policy": "manual"}},
    }
    return gateway("--config", write_config(tmp_path, config), *args)


async def served_by(stub: Any, request_id: str) -> str:
    call = stub.Generate(sgl_generate(request_id, tokens=1), metadata=model_md("m"), timeout=WAIT_S)
    _, error = await collect(call)
    assert error is None, error
    return str(dict(await call.initial_metadata())["x-sim-worker"])


async def gone(admin: str, worker_id: str, within_s: float) -> float:
    """Seconds until ListWorkers no longer shows the worker; fails past `within_s`."""
    start = time.monotonic()
    while worker_id in await list_workers(admin):
        assert time.monotonic() - start <= within_s, f"{worker_id} still listed"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_a_pod_gets_calls_only_while_ready(
    sim: Launcher, gateway: Launcher, kube: InThread, tmp_path: Path, strict: bool
) -> None:
    """Out of service as its Pod is not Ready, still listed (never before the grace,
    gone within 3 s of it in the timing tier); a terminating Pod's worker goes at once:
    within GRACE_S - 1 s, or on a busy machine within five times the time the gateway
    took to see the other Pod unready, and a second."""
    a = sim("--listen", f"{A}:0", "--model", "m", "--name", "a")
    b = sim("--listen", f"{B}:0", "--model", "m", "--name", "b")
    api = kube.server
    worker = {"labels": {"app": "worker"}, "phase": "Running"}
    kube.do(api.add_pod, NS, "a", ip=A, ports={"grpc": a.port}, ready=True, **worker)
    kube.do(api.add_pod, NS, "b", ip=B, ports={"grpc": b.port}, ready=False, **worker)
    gw = serve(gateway, tmp_path, kube, {"selector": "app=worker", "unready_grace_s": GRACE_S})
    await wait_health(gw.address, "m")
    admin = admin_address(gw)
    a_id, b_id = f"{A}:{a.port}", f"{B}:{b.port}"
    workers = await list_workers(admin)
    assert list(workers) == [a_id]  # b is listed, but was never Ready: never joined
    assert list(workers[a_id].sources) == [f"kubernetes:{NS}/a"]
    assert workers[a_id].in_service
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        kube.do(api.set_ready, NS, "b", True)
        await wait_worker(admin, b_id, lambda w: is_ready(w) and w.in_service)
        assert {await served_by(stub, f"ready-{i}") for i in range(6)} == {"a", "b"}

        kube.do(api.set_ready, NS, "b", False)  # out of service at once, listed a while
        left = time.monotonic()
        listed = await wait_worker(admin, b_id, lambda w: not w.in_service)
        seen_out_s = time.monotonic() - left
        assert list(listed.sources) == [f"kubernetes:{NS}/b"]
        assert [await served_by(stub, f"unready-{i}") for i in range(6)] == ["a"] * 6
        if strict:
            assert time.monotonic() - left < GRACE_S, "too slow to see b out of service"
        took = await gone(admin, b_id, GRACE_S + 3.0 if strict else WAIT_S)
        assert time.monotonic() - left >= GRACE_S - 0.5, f"b left after {took:.2f} s"

        kube.do(api.set_ready, NS, "b", True)  # back: a fresh host
        await wait_worker(admin, b_id, lambda w: is_ready(w) and w.in_service)
        kube.do(api.mark_terminating, NS, "a")  # terminating: drained and gone at once
        at_once_s = GRACE_S - 1.0
        await gone(admin, a_id, at_once_s if strict else max(at_once_s, 5 * seen_out_s + 1.0))
        assert [await served_by(stub, f"last-{i}") for i in range(4)] == ["b"] * 4


async def test_prefill_and_decode_pods_make_sglang_pd_pairs(
    sim: Launcher, gateway: Launcher, kube: InThread, tmp_path: Path
) -> None:
    prefill = sim("--listen", f"{A}:0", "--role", "prefill", "--model", "m", "--name", "p")
    decode = sim("--listen", f"{B}:0", "--role", "decode", "--model", "m", "--name", "d")
    bootstrap = prefill.port_of("bootstrap")
    api = kube.server
    kube.do(
        api.add_pod,
        NS,
        "prefill-0",
        labels={"app": "m", "leg": "prefill"},
        annotations={BOOTSTRAP: str(bootstrap)},
        ip=A,
        ports={"grpc": prefill.port},
        phase="Running",
        ready=True,
    )
    kube.do(
        api.add_pod,
        NS,
        "decode-0",
        labels={"app": "m", "leg": "decode"},
        ip=B,
        ports={"grpc": decode.port},
        phase="Running",
        ready=True,
    )
    gw = serve(
        gateway,
        tmp_path,
        kube,
        {
            "selector": "app=m,leg=prefill",
            "role": "prefill",
            "bootstrap_port_annotation": BOOTSTRAP,
        },
        {"selector": "app=m,leg=decode", "role": "decode"},
    )
    await wait_health(gw.address, "m")
    admin = admin_address(gw)
    p_id, d_id = f"{A}:{prefill.port}", f"{B}:{decode.port}"
    p = await wait_worker(admin, p_id, is_ready)
    d = await wait_worker(admin, d_id, is_ready)
    assert (p.role, p.bootstrap_port) == (admin_pb.ROLE_PREFILL, bootstrap)
    assert list(p.sources) == [f"kubernetes:{NS}/prefill-0"]
    assert (d.role, d.HasField("bootstrap_port")) == (admin_pb.ROLE_DECODE, False)
    assert list(d.sources) == [f"kubernetes:{NS}/decode-0"]
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(3):
            call = stub.Generate(sgl_generate(f"pd-{i}", tokens=4), metadata=model_md("m"))
            messages, error = await collect(call)
            assert error is None, error
            kinds = [m.WhichOneof("response") for m in messages]
            assert kinds[-1] == "complete", kinds
        # The decode Pod not Ready: no pair can be made, the model is not servable.
        kube.do(api.set_ready, NS, "decode-0", False)
        await wait_health(gw.address, "m", healthy=False)


async def test_with_two_processes_one_watch_feeds_both(
    sim: Launcher, gateway: Launcher, kube: InThread, tmp_path: Path
) -> None:
    a = sim("--listen", f"{A}:0", "--model", "m", "--name", "a")
    b = sim("--listen", f"{B}:0", "--model", "m", "--name", "b")
    api = kube.server
    worker = {"labels": {"app": "worker"}, "phase": "Running"}
    kube.do(api.add_pod, NS, "a", ip=A, ports={"grpc": a.port}, ready=True, **worker)
    gw = serve(gateway, tmp_path, kube, {"selector": "app=worker"}, args=("--processes", "2"))
    await wait_health(gw.address, "m")
    channels = await per_process(gw)
    try:
        kube.do(api.add_pod, NS, "b", ip=B, ports={"grpc": b.port}, ready=True, **worker)
        added = time.monotonic()
        for ch in channels.values():  # each serving process places calls on b
            stub = sgl_grpc.SglangSchedulerStub(ch)
            while "b" not in {await served_by(stub, f"two-{i}") for i in range(4)}:
                assert time.monotonic() - added < WAIT_S, "b got no call from this process"
        # One list and one watch in all (the supervisor's), not one per process.
        assert (kube.do(lambda: api.lists), kube.do(lambda: api.watches)) == (1, 1)
        assert kube.do(lambda: api.open_watches) == 1
    finally:
        for ch in channels.values():
            await ch.close()
