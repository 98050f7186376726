"""The gateway's own grpc.health.v1 service: exact names, Check from
memory, List, and Watch streams that see every change, for every watcher.

One fleet serves the module: `m` (sglang, one worker the tests flip with SIGUSR1/SIGUSR2
and always flip back), `v` (vllm) and `h` (sglang, a worker whose grpc.health never
answers, so it is never ready).
"""

from __future__ import annotations

import json
import signal
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_sim.client import (
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVING,
    SGL_SERVICE,
    VLLM_SERVICE,
    channel,
    wait_health_status,
)
from gateway_sim.launch import Child, SharedProcesses, worker_url
from tests.support.availability import health_list, health_watch
from tests.support.launch import grpcurl
from tests.support.waits import WAIT_S

PROBE_INTERVAL_S = 0.2
NAMES = {"", "liveness", "readiness", SGL_SERVICE, VLLM_SERVICE, "models/m", "models/v", "models/h"}


def is_status(want: int) -> Callable[[int], bool]:
    return lambda status: status == want


@dataclass(frozen=True)
class Fleet:
    gateway: Child
    m: Child  # the only worker of model m

    def flip(self, serving: bool) -> float:
        self.m.process.send_signal(signal.SIGUSR2 if serving else signal.SIGUSR1)
        return time.monotonic()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    shared = SharedProcesses(tmp_path_factory.mktemp("health"))
    try:
        m, v, h = shared.sims(
            ("--model", "m", "--name", "m0"),
            ("--runtime", "vllm", "--model", "v", "--name", "v0"),
            ("--model", "h", "--name", "h0", "--health-hang"),
        )
        gw = shared.gateway(
            "--admin-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--drain-delay",
            "0",
            "--probe-interval",
            str(PROBE_INTERVAL_S),
            "--worker",
            worker_url(m, model="m", runtime="sglang"),
            "--worker",
            worker_url(v, model="v", runtime="vllm"),
            "--worker",
            worker_url(h, model="h", runtime="sglang"),
        )
        yield Fleet(gw, m)
    finally:
        shared.stop()


@pytest.fixture
async def ready(fleet: Fleet) -> AsyncIterator[Fleet]:
    """The fleet with m serving, before and after the test."""
    await wait_health_status(fleet.gateway.address, "models/m", SERVING)
    await wait_health_status(fleet.gateway.address, "models/v", SERVING)
    yield fleet
    fleet.flip(True)
    await wait_health_status(fleet.gateway.address, "models/m", SERVING)


EXPECTED = {
    "": "SERVING",
    "liveness": "SERVING",
    "readiness": "SERVING",
    SGL_SERVICE: "SERVING",
    VLLM_SERVICE: "SERVING",
    "models/m": "SERVING",
    "models/v": "SERVING",
    "models/h": "NOT_SERVING",
}


def test_grpcurl_check_and_list_answer_every_name(ready: Fleet) -> None:
    address = ready.gateway.address
    listed = grpcurl("-plaintext", "-d", "{}", address, "grpc.health.v1.Health/List")
    assert listed.returncode == 0, listed.stderr
    statuses = {
        name: entry["status"] for name, entry in json.loads(listed.stdout)["statuses"].items()
    }
    assert statuses == EXPECTED
    for name, status in EXPECTED.items():
        checked = grpcurl(
            "-plaintext",
            "-d",
            json.dumps({"service": name}),
            address,
            "grpc.health.v1.Health/Check",
        )
        assert checked.returncode == 0, (name, checked.stderr)
        assert json.loads(checked.stdout) == {"status": status}, name

    unknown = grpcurl(
        "-plaintext", "-d", '{"service":"models/nope"}', address, "grpc.health.v1.Health/Check"
    )
    assert unknown.returncode == 64 + grpc.StatusCode.NOT_FOUND.value[0], unknown.stderr
    assert "Code: NotFound" in unknown.stderr
    assert "Message: unknown service 'models/nope'" in unknown.stderr


@pytest.mark.serial  # max latency 250 ms
async def test_check_answers_from_memory(ready: Fleet, strict: bool) -> None:
    """Even for a model whose only worker never answers its probe: every name answered as
    quick as the rest, none waiting on a probe (each name's median within 5 times the
    overall one and 50 ms: a busy machine makes a call late now and then, a probe would
    make all of that name's late; the slowest call within 0.25 s in the timing tier)."""
    latencies: list[float] = []
    by_name: dict[str, list[float]] = {name: [] for name in NAMES}
    async with channel(ready.gateway.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in sorted(NAMES) * 10:
            began = time.perf_counter()
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=WAIT_S)
            latencies.append(time.perf_counter() - began)
            by_name[name].append(latencies[-1])
            assert health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) == EXPECTED[name]
        with pytest.raises(aio.AioRpcError) as caught:
            await stub.Check(health_pb2.HealthCheckRequest(service="liveness "), timeout=WAIT_S)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    print(
        f"\n[health] Check latency over {len(latencies)} calls: median "
        f"{statistics.median(latencies) * 1000:.2f} ms, max {max(latencies) * 1000:.2f} ms"
    )
    overall = statistics.median(latencies)
    for name, taken in by_name.items():
        assert statistics.median(taken) < 5 * overall + 0.05, (name, taken)
    if strict:
        assert max(latencies) < 0.25


async def test_watch_of_an_unknown_name_starts_with_service_unknown(ready: Fleet) -> None:
    async with channel(ready.gateway.address) as ch:
        unknown = health_watch(ch, "models/nope")
        known = health_watch(ch, "readiness")
        await unknown.wait_for(lambda s: True, WAIT_S)
        await known.wait_for(lambda s: True, WAIT_S)
        ready.flip(False)
        await wait_health_status(ready.gateway.address, "models/m", NOT_SERVING)
        # The stream stays open (the name may appear later) and says nothing more.
        assert unknown.error is None
        await unknown.close()
        await known.close()
    assert [s for _, s in unknown.items] == [SERVICE_UNKNOWN]
    assert [s for _, s in known.items] == [SERVING]  # v keeps the gateway ready


async def test_watch_sees_every_transition_of_a_model(ready: Fleet) -> None:
    address = ready.gateway.address
    flips = (False, True, False, True)
    timings = []
    async with channel(address) as ch:
        model = health_watch(ch, "models/m")
        service = health_watch(ch, SGL_SERVICE)  # m is its only servable model
        other = health_watch(ch, "models/v")
        await model.wait_for(lambda s: s == SERVING, WAIT_S)
        await service.wait_for(lambda s: s == SERVING, WAIT_S)
        for serving in flips:
            flipped = ready.flip(serving)
            want = SERVING if serving else NOT_SERVING
            seen, _ = await model.wait_for(is_status(want), WAIT_S, after=flipped)
            await service.wait_for(is_status(want), WAIT_S, after=flipped)
            timings.append(f"{'SERVING' if serving else 'NOT_SERVING'} {seen - flipped:.3f}s")
        statuses = await health_list(address)
        for watch in (model, service, other):
            await watch.close()
    print(f"\n[health] models/m Watch saw each flip after: {', '.join(timings)}")
    expected = [SERVING, NOT_SERVING, SERVING, NOT_SERVING, SERVING]
    assert [s for _, s in model.items] == expected
    assert [s for _, s in service.items] == expected
    assert [s for _, s in other.items] == [SERVING]
    assert statuses == EXPECTED


async def test_a_watcher_leaving_does_not_silence_the_others(ready: Fleet) -> None:
    """The stock aio servicer loses updates for the remaining watchers of a name once one
    of them goes away; here each watcher has its own stream of changes."""
    address = ready.gateway.address
    async with channel(address) as ch1, channel(address) as ch2:
        first = health_watch(ch1, "models/m")
        second = health_watch(ch2, "models/m")
        same_channel = health_watch(ch2, "models/m")
        for watch in (first, second, same_channel):
            await watch.wait_for(lambda s: s == SERVING, WAIT_S)
        await first.close()

        flipped = ready.flip(False)
        await second.wait_for(lambda s: s == NOT_SERVING, WAIT_S, after=flipped)
        await same_channel.wait_for(lambda s: s == NOT_SERVING, WAIT_S, after=flipped)
        await same_channel.close()

        late = health_watch(ch1, "models/m")  # a new watcher after others left
        await late.wait_for(lambda s: s == NOT_SERVING, WAIT_S)
        flipped = ready.flip(True)
        await second.wait_for(lambda s: s == SERVING, WAIT_S, after=flipped)
        await late.wait_for(lambda s: s == SERVING, WAIT_S, after=flipped)
        await second.close()
        await late.close()
    assert [s for _, s in first.items] == [SERVING]
    assert [s for _, s in second.items] == [SERVING, NOT_SERVING, SERVING]
    assert [s for _, s in same_channel.items] == [SERVING, NOT_SERVING]
    assert [s for _, s in late.items] == [NOT_SERVING, SERVING]
