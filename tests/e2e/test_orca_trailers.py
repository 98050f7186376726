"""The `endpoint-load-metrics-bin` trailer, read off the wire with a raw HTTP/2 client
(grpcio's own client consumes it for its load balancing and never shows it): once on an
answer, on a relayed worker failure and on the gateway's own refusal (Trailers-Only),
decoding as an ORCA OrcaLoadReport; none with `orca.trailers: false`; with
`--processes 2`, each process's own load."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from gateway.orca.report import IN_FLIGHT
from gateway.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from gateway_sim.client import channel, sgl_generate, sgl_grpc, write_config
from gateway_sim.launch import worker_url
from tests.e2e.rawclient import RawClient, Stream
from tests.support.launch import Launcher

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
LOAD = b"endpoint-load-metrics-bin"


async def call(port: int, *metadata: tuple[bytes, bytes], model: bytes = b"m") -> Stream:
    client = RawClient("127.0.0.1", port)
    await client.connect()
    try:
        request = sgl_generate("r1").SerializeToString()
        stream = client.open(GENERATE, [(b"x-model-id", model), *metadata], request)
        async with asyncio.timeout(10):
            await stream.ended.wait()
        return stream
    finally:
        await client.close()


def unbase64(value: bytes) -> bytes:
    """A `-bin` value as it travels: base64, its padding often left out."""
    return base64.b64decode(value + b"=" * (-len(value) % 4))


def load_reports(stream: Stream) -> list[OrcaLoadReport]:
    return [OrcaLoadReport.FromString(unbase64(v)) for k, v in stream.fields if k == LOAD]


@pytest.fixture
def port(sim: Launcher, gateway: Launcher) -> int:
    worker = sim("--model", "m", "--runtime", "sglang")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    port: int = gw.port
    return port


async def test_an_answer_carries_one_load_report(port: int) -> None:
    await call(port)  # a call that ends before the next: counted in the next report
    await asyncio.sleep(0.15)  # past the report's refresh period (100 ms)
    stream = await call(port)
    assert stream.status == 0
    (report,) = load_reports(stream)
    assert report.rps_fractional > 0  # the first call ended within the window
    assert report.named_metrics[IN_FLIGHT] == 1  # this call, still in flight as it ends
    assert report.application_utilization > 0 and report.cpu_utilization > 0


async def test_a_relayed_failure_carries_the_workers_trailers_and_one_load_report(
    port: int,
) -> None:
    stream = await call(port, (b"x-sim-fail-code", b"INTERNAL"))
    assert stream.status == 13
    assert b"x-sim-failure" in stream.headers  # the worker's own trailer, relayed
    assert len(load_reports(stream)) == 1


async def test_a_refusal_carries_one_load_report_trailers_only(port: int) -> None:
    stream = await call(port, model=b"nope")
    assert stream.status == 5  # NOT_FOUND, Trailers-Only: one header block
    assert stream.headers[b"x-http-status"] == b"404"
    assert not stream.data
    assert len(load_reports(stream)) == 1


async def test_trailers_off_in_the_config(sim: Launcher, gateway: Launcher, tmp_path: Path) -> None:
    worker = sim("--model", "m", "--runtime", "sglang")
    config = write_config(tmp_path, {"orca": {"trailers": False}})
    port = gateway("--config", config, "--worker", worker_url(worker, model="m")).port
    for stream in (await call(port), await call(port, model=b"nope")):
        assert stream.status in (0, 5)
        assert LOAD not in stream.headers


async def test_each_serving_process_reports_its_own_load(sim: Launcher, gateway: Launcher) -> None:
    """--processes 2: calls held on one connection (one process) show in that process's
    reports only; connections spread over both processes see both."""
    worker = sim("--model", "m", "--runtime", "sglang")
    port = gateway("--processes", "2", "--worker", worker_url(worker, model="m")).port
    held_md = (("x-model-id", "m"), ("x-sim-ttft-ms", "30000"), ("x-sim-headers-first", "1"))
    async with channel(f"127.0.0.1:{port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = [stub.Generate(sgl_generate(f"held-{i}"), metadata=held_md) for i in range(3)]
        for call_ in held:
            await call_.initial_metadata()  # the worker took it: in flight
        seen = set()
        for _ in range(16):  # new connections, spread by the kernel over the processes
            await asyncio.sleep(0.11)  # past the report's refresh period
            (report,) = load_reports(await call(port))
            seen.add(report.named_metrics[IN_FLIGHT])
        for call_ in held:
            call_.cancel()
    assert seen == {4.0, 1.0}  # the held calls and the report's own call; its own alone
