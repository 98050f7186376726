"""The admin API and metrics against a running gateway: the `gateway workers` verbs, a
worker drained and removed under load, the bearer token, the Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.client import (
    SGL_SERVICE,
    admin_address,
    channel,
    closed_port,
    collect,
    dead_worker_url,
    list_workers,
    model_md,
    sgl_generate,
    sgl_grpc,
)
from gateway_sim.launch import START_S, Child, SharedProcesses, worker_url
from tests.support.availability import is_ready, labels, run_cli_async, samples, scrape, wait_worker
from tests.support.helpers import wait_for_events
from tests.support.launch import STOP_S, Launcher, SimHost, grpcurl
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S

MISSING = "the admin API needs the metadata 'authorization: Bearer <token>'"
REJECTED = "the admin token was not accepted"


@dataclass(frozen=True)
class Workers:
    a: Child
    b: Child

    def named(self, name: str) -> Child:
        return {"a": self.a, "b": self.b}[name]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, sim_host: SimHost) -> Iterator[Workers]:
    """Two workers of model m; each test puts its own gateway in front (admin changes
    live in the gateway, the workers are left as they were)."""
    shared = SharedProcesses(tmp_path_factory.mktemp("admin"), sim_host)
    try:
        a, b = shared.sims(("--model", "m", "--name", "a"), ("--model", "m", "--name", "b"))
        yield Workers(a, b)
    finally:
        shared.stop()


def url(child: Child) -> str:
    return worker_url(child, model="m", runtime="sglang")


def cli(verb: str, admin: str, *args: str) -> list[str]:
    return ["workers", verb, "--admin", admin, *args]


async def test_cli_list_add_remove_and_watch(workers: Workers, gateway: Launcher) -> None:
    a, b = workers.a, workers.b
    gw = gateway("--probe-interval", "0.2", "--worker", url(a))
    admin = admin_address(gw)
    await wait_worker(admin, a.address, is_ready)

    watcher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        *cli("watch", admin, "--json"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        # Subscribed once its snapshot is out; only then does the fleet change.
        assert watcher.stdout is not None
        listing = asyncio.create_task(run_cli_async(*cli("list", admin)))  # changes nothing
        first = await asyncio.wait_for(watcher.stdout.readline(), START_S)
        listed = await listing
        assert listed.returncode == 0, listed.stderr
        header, *rows = listed.stdout.splitlines()
        assert header.split() == [
            "WORKER", "MODEL", "RUNTIME", "ROLE", "SOURCE", "STATUS", "INFLIGHT", "OUTLIER",
            "RUN", "WAIT", "KV", "LORA", "LAST", "PROBE", "CAUSE",
        ]  # fmt: skip
        [row] = rows
        assert row.split()[:13] == [
            a.address, "m", "sglang", "regular", "static", "ready", "0", "closed", "0", "0", "0%",
            "-", "serving",
        ]  # fmt: skip
        assert row.endswith("ago  probe: grpc.health SERVING")

        # A URL without model or runtime: the gateway asks the worker before answering.
        added = await run_cli_async(*cli("add", admin, f"grpc://{b.address}"))
        assert added.returncode == 0, added.stderr
        assert re.fullmatch(
            rf"added {b.address} \(model m, runtime sglang, role regular\): (pending|ready)\n",
            added.stdout,
        ), added.stdout
        await wait_worker(admin, b.address, is_ready)

        as_json = await run_cli_async(*cli("list", admin, "--json"))
        assert as_json.returncode == 0, as_json.stderr
        entries = [json.loads(line) for line in as_json.stdout.splitlines()]
        assert [e["id"] for e in entries] == sorted([a.address, b.address])
        for entry in entries:
            assert entry["status"] == "WORKER_STATUS_READY"
            assert entry["url"] == f"grpc://{entry['id']}?model=m&runtime=sglang&role=regular"
            assert entry["breaker_state"] == "BREAKER_STATE_CLOSED"
            assert entry["connected"] is True

        duplicate, bad_url, removed = await asyncio.gather(
            run_cli_async(*cli("add", admin, url(b))),
            run_cli_async(*cli("add", admin, "http://127.0.0.1:1")),
            run_cli_async(*cli("remove", admin, a.address)),
        )
        assert (duplicate.returncode, duplicate.stdout) == (4, "")  # ALREADY_EXISTS
        assert duplicate.stderr == (
            f"gateway: ALREADY_EXISTS: worker {b.address} is already registered\n"
        )
        assert (bad_url.returncode, bad_url.stdout) == (2, "")  # INVALID_ARGUMENT
        assert bad_url.stderr == (
            "gateway: INVALID_ARGUMENT: worker 'http://127.0.0.1:1': scheme must be grpc:// or grpcs://\n"
        )
        assert removed.returncode == 0, removed.stderr
        assert removed.stdout == f"removed {a.address} (drained)\n"

        gone, once = await asyncio.gather(
            run_cli_async(*cli("remove", admin, a.address)),
            run_cli_async(*cli("watch", admin, "--count", "1")),
        )
        assert gone.returncode == 3  # NOT_FOUND
        assert gone.stderr == f"gateway: NOT_FOUND: no worker '{a.address}' is registered\n"
        assert once.returncode == 0, once.stderr
        assert re.fullmatch(
            rf"\d\d:\d\d:\d\d snapshot {b.address} m sglang regular ready: "
            r"probe: grpc\.health SERVING\n",
            once.stdout,
        ), once.stdout
        assert list((await list_workers(admin)).keys()) == [b.address]
        async with channel(gw.address) as ch:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("m"))
            messages, error = await collect(call)
        assert error is None and len(messages) == 5
        assert dict(await call.initial_metadata())["x-sim-worker"] == "b"
    finally:
        watcher.send_signal(signal.SIGINT)
        try:
            out, err = await asyncio.wait_for(watcher.communicate(), STOP_S)
        except TimeoutError:
            watcher.kill()
            out, err = await watcher.communicate()
    assert watcher.returncode == 130, err
    events = [json.loads(line) for line in (first + out).decode().splitlines()]
    story = [
        (
            e["kind"].removeprefix("WORKER_EVENT_KIND_"),
            e["worker"]["id"],
            e.get("status_change", {}).get("new_status", "").removeprefix("WORKER_STATUS_"),
        )
        for e in events
    ]
    expected = [
        ("SNAPSHOT", a.address, ""),
        ("ADDED", b.address, ""),
        ("STATUS", b.address, "READY"),
        ("STATUS", a.address, "DRAINING"),
        ("REMOVED", a.address, ""),
    ]
    assert story[0] == expected[0]
    position = 0
    for step in story:  # the expected events, in this order, among any others
        if position < len(expected) and step == expected[position]:
            position += 1
    assert position == len(expected), story


async def test_drained_worker_gets_nothing_new_while_its_stream_finishes(
    workers: Workers, gateway: Launcher
) -> None:
    gw = gateway("--probe-interval", "0.2", "--worker", url(workers.a), "--worker", url(workers.b))
    admin = admin_address(gw)
    for worker in (workers.a, workers.b):
        await wait_worker(admin, worker.address, is_ready)
    run_alone()
    token_ms = 100
    # The held streams outlive a CLI call and six calls: 2 s plus three times a CLI call
    # timed here (some 0.5 s idle, seconds on a busy machine).
    began = time.monotonic()
    listed = await run_cli_async(*cli("list", admin))
    assert listed.returncode == 0, listed.stderr
    tokens = math.ceil((2.0 + 3 * (time.monotonic() - began)) * 1000 / token_ms)

    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)

        def held(request_id: str, tokens: int) -> Any:
            return stub.Generate(
                sgl_generate(request_id, tokens=tokens),
                metadata=model_md("m", ("x-sim-token-ms", str(token_ms))),
                timeout=tokens * token_ms / 1000 + WAIT_S,
            )

        call = held("held", tokens)
        name = str(dict(await call.initial_metadata())["x-sim-worker"])
        holder, other = workers.named(name), workers.named("a" if name == "b" else "b")
        reader = asyncio.create_task(collect(call))

        drained = await run_cli_async(*cli("drain", admin, holder.address))
        assert drained.returncode == 0, drained.stderr
        assert drained.stdout == f"draining {holder.address} (1 requests in flight)\n"
        state = (await list_workers(admin))[holder.address]
        assert state.status == admin_pb.WORKER_STATUS_DRAINING
        assert state.inflight == 1

        served = []
        for i in range(6):
            c = stub.Generate(sgl_generate(f"after{i}", tokens=1), metadata=model_md("m"))
            messages, error = await collect(c)
            assert error is None and len(messages) == 2
            served.append(dict(await c.initial_metadata())["x-sim-worker"])
        assert served == [other_name := ("a" if name == "b" else "b")] * 6
        assert not reader.done()  # all of that while the drained worker's stream ran

        messages, error = await reader
        assert error is None
        assert len(messages) == tokens + 1
        state = (await list_workers(admin))[holder.address]
        assert (state.status, state.inflight) == (admin_pb.WORKER_STATUS_DRAINING, 0)
        idle = await run_cli_async(*cli("drain", admin, holder.address, "--wait", "1"))
        assert idle.stdout == f"draining {holder.address} (idle)\n"

        # Removing the other one waits for its in-flight stream, which completes.
        call = held("last", tokens)
        assert dict(await call.initial_metadata())["x-sim-worker"] == other_name
        reader = asyncio.create_task(collect(call))
        began = time.monotonic()
        drain_s = str(math.ceil(tokens * token_ms / 1000 + WAIT_S))
        removed = await run_cli_async(
            *cli("remove", admin, other.address, "--drain-timeout", drain_s)
        )
        took = time.monotonic() - began
        assert removed.returncode == 0, removed.stderr
        assert removed.stdout == f"removed {other.address} (drained)\n"
        assert reader.done()
        messages, error = await reader
        assert error is None and len(messages) == tokens + 1

        # Nothing routable is left: one draining worker.
        _, error = await collect(stub.Generate(sgl_generate(), metadata=model_md("m")))
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        assert error.details() == (
            "All 1 regular workers for model 'm' are unavailable "
            "(not connected, unhealthy or ejected by outlier detection)"
        )
    print(f"\n[admin] remove waited {took:.3f}s for the in-flight stream on the removed worker")
    log_path = gw.log_path
    events = wait_for_events(log_path, 9, rpc="Generate")
    by_id = {e["request_id"]: e for e in events if e.get("request_id")}
    assert by_id["held"]["worker"] == holder.address and by_id["held"]["code"] == "OK"
    assert {by_id[f"after{i}"]["worker"] for i in range(6)} == {other.address}
    assert by_id["last"]["code"] == "OK"


async def test_admin_token_is_required_on_the_admin_port_only(
    workers: Workers, gateway: Launcher
) -> None:
    token = "s3cret"
    gw = gateway("--admin-token", token, "--worker", url(workers.a))
    admin = admin_address(gw)
    async with aio.insecure_channel(admin) as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        for metadata, message in (
            (None, MISSING),
            ((("authorization", "Bearer nope"),), REJECTED),
            ((("authorization", f"Basic {token}"),), MISSING),
        ):
            with pytest.raises(aio.AioRpcError) as caught:
                await stub.ListWorkers(admin_pb.ListWorkersRequest(), metadata=metadata, timeout=2)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert caught.value.details() == message
        watch = stub.WatchWorkers(admin_pb.WatchWorkersRequest(), timeout=2)
        with pytest.raises(aio.AioRpcError) as caught:
            await watch.read()
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        listed = await stub.ListWorkers(
            admin_pb.ListWorkersRequest(), metadata=(("authorization", f"Bearer {token}"),)
        )
        assert [w.id for w in listed.workers] == [workers.a.address]

    without, flag, env = await asyncio.gather(
        run_cli_async(*cli("list", admin)),
        run_cli_async(*cli("list", admin, "--token", token, "--json")),
        run_cli_async(*cli("list", admin, "--json"), env={"GATEWAY_ADMIN_TOKEN": token}),
    )
    assert (without.returncode, without.stdout) == (6, "")  # UNAUTHENTICATED
    assert without.stderr == f"gateway: UNAUTHENTICATED: {MISSING}\n"
    for ok in (flag, env):
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["id"] == workers.a.address
    # Reflection on the admin port is behind the token too; the main port needs none.
    reflected = grpcurl("-plaintext", admin, "list")
    assert reflected.returncode != 0
    assert "Unauthenticated" in reflected.stderr
    async with channel(gw.address) as ch:
        messages, error = await collect(
            sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("m"))
        )
    assert error is None and len(messages) == 5


async def test_metrics_count_calls_verdicts_and_workers(
    workers: Workers, gateway: Launcher
) -> None:
    nobody = closed_port()
    dead = f"127.0.0.1:{nobody.getsockname()[1]}"
    gw = gateway(
        "--worker", url(workers.a), "--worker", dead_worker_url(nobody, model="d", runtime="sglang")
    )
    await wait_worker(admin_address(gw), workers.a.address, is_ready)
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(3):
            _, error = await collect(stub.Generate(sgl_generate(f"ok{i}"), metadata=model_md("m")))
            assert error is None
        failing = model_md("m", ("x-sim-fail-code", "INVALID_ARGUMENT"))
        _, error = await collect(stub.Generate(sgl_generate("bad"), metadata=failing))
        assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT
        _, error = await collect(stub.Generate(sgl_generate("down"), metadata=model_md("d")))
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        _, error = await collect(stub.Generate(sgl_generate("nope"), metadata=model_md("nope")))
        assert error is not None and error.code() is grpc.StatusCode.NOT_FOUND
    wait_for_events(gw.log_path, 6, rpc="Generate")
    text = scrape(gw)

    def generate(model: str, code: str) -> frozenset[tuple[str, str]]:
        return labels(model=model, service=SGL_SERVICE, rpc="Generate", code=code)

    requests = {
        k: v for k, v in samples(text, "gateway_requests_total").items() if ("rpc", "Generate") in k
    }
    assert requests == {
        generate("m", "OK"): 3.0,
        generate("m", "INVALID_ARGUMENT"): 1.0,
        generate("d", "UNAVAILABLE"): 1.0,
        generate("", "NOT_FOUND"): 1.0,  # a model no worker serves is not a label value
    }
    assert samples(text, "gateway_verdicts_total") == {
        labels(model="d", reason="WORKERS_UNAVAILABLE", leg="regular"): 1.0,
        labels(model="", reason="MODEL_NOT_FOUND", leg=""): 1.0,
    }
    assert samples(text, "gateway_worker_up") == {
        labels(worker=workers.a.address, model="m", runtime="sglang", role="regular"): 1.0,
        labels(worker=dead, model="d", runtime="sglang", role="regular"): 0.0,
    }
    assert samples(text, "gateway_worker_inflight") == {
        labels(worker=workers.a.address): 0.0,
        labels(worker=dead): 0.0,
    }
    status = samples(text, "gateway_worker_status")
    assert status[labels(worker=workers.a.address, status="ready")] == 1.0
    assert sum(v for k, v in status.items() if ("worker", workers.a.address) in k) == 1.0
    first = samples(text, "gateway_first_message_seconds_count")
    assert first == {labels(model="m", service=SGL_SERVICE): 3.0}
    assert samples(text, "gateway_retries_total") == {}
    del nobody
