"""A worker's headers and trailers as the client gets them, with a real worker process
(sim/gateway_sim/trailers_worker.py) and a real gateway: a worker's 14 KB of trailers (over
grpc's soft metadata limit of 8 KiB, under its hard one of 16 KiB) end a complete
stream OK, cut to `upstream.max_relayed_metadata_bytes`, the gateway's own trailers
added, the cut counted and logged; response headers likewise; an OK answer carries
none of a worker's failure keys (`x-http-status`, `grpc-status-details-bin`).

The client here refuses any header block over 8 KiB, always (grpc's soft limit, made
hard): a default client refuses one between 8 and 16 KiB only at random."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway.proxy.metadata import entry_size
from gateway_sim.client import collect, model_md, sgl_generate, sgl_grpc, trailers
from gateway_sim.launch import Child, ready, worker_url
from gateway_sim.trailers_worker import ENTRY_BYTES
from tests.e2e.rawclient import RawClient
from tests.support.availability import labels, samples, scrape
from tests.support.launch import Launcher

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
SOFT_LIMIT = 8192  # grpc's soft metadata limit, the most a default client always takes
WORKER_BYTES = 14_000
WORKER_PADS = math.ceil(WORKER_BYTES / ENTRY_BYTES)  # 55 entries, 14080 bytes
KEPT_PADS = 4096 // ENTRY_BYTES  # upstream.max_relayed_metadata_bytes: 4 KiB
MESSAGES = 5  # 4 chunks and a Complete
DROPPED = "gateway_relayed_metadata_dropped_total"


@pytest.fixture
def worker(processes: list[Child]) -> Child:
    args = [sys.executable, "-m", "gateway_sim.trailers_worker"]
    child = ready(subprocess.Popen(args, stdout=subprocess.PIPE, text=True), args)
    processes.append(child)
    return child


@pytest.fixture
def gw(worker: Child, gateway: Launcher) -> Child:
    return gateway("--worker", worker_url(worker, model="m", runtime="sglang"))


def strict(address: str) -> aio.Channel:
    """A client that refuses every header block over 8 KiB."""
    options = [
        ("grpc.max_metadata_size", SOFT_LIMIT),
        ("grpc.absolute_max_metadata_size", SOFT_LIMIT),
    ]
    return aio.insecure_channel(address, options=options)


async def generate(channel: aio.Channel, *metadata: tuple[str, str]) -> tuple[list[Any], Any]:
    """(messages, None) and the call's headers and trailers; or (messages, error)."""
    call = sgl_grpc.SglangSchedulerStub(channel).Generate(
        sgl_generate(), metadata=model_md("m", *metadata), timeout=10
    )
    messages, error = await collect(call)
    if error is not None:
        return messages, error
    return messages, (dict(await call.initial_metadata()), dict(await call.trailing_metadata()))


def logged(gw: Child, event: str) -> list[dict[str, Any]]:
    """The gateway's log lines of `event` (JSON lines)."""
    path: Path = gw.log_path
    lines = []
    for text in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            line = json.loads(text)
            if line.get("event") == event:
                lines.append(line)
    return lines


def padded(metadata: dict[str, Any]) -> list[str]:
    return sorted(key for key in metadata if key.startswith("x-pad-"))


async def raw_call(port: int, *metadata: tuple[bytes, bytes]) -> Any:
    """One Generate read off the wire: every header and trailer field as sent."""
    client = RawClient("127.0.0.1", port)
    await client.connect()
    try:
        request = sgl_generate().SerializeToString()
        stream = client.open(GENERATE, [(b"x-model-id", b"m"), *metadata], request)
        async with asyncio.timeout(10):
            await stream.ended.wait()
        return stream
    finally:
        await client.close()


@pytest.fixture
async def client(gw: Child) -> AsyncIterator[aio.Channel]:
    async with strict(gw.address) as channel:
        yield channel


async def test_a_workers_14_kb_of_trailers_end_a_complete_stream_ok_cut_and_counted(
    worker: Child, gw: Child, client: aio.Channel
) -> None:
    asked = ("x-trailer-bytes", str(WORKER_BYTES))
    async with strict(worker.address) as direct:  # what the gateway is asked to relay
        _, error = await generate(direct, asked)
    assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    for _ in range(3):
        messages, answer = await generate(client, asked)
        assert not isinstance(answer, aio.AioRpcError), answer
        assert len(messages) == MESSAGES
        _, trailing = answer
        assert padded(trailing) == [f"x-pad-{i:03d}" for i in range(KEPT_PADS)]  # in order
    stream = await raw_call(gw.port, (asked[0].encode(), asked[1].encode()))
    assert stream.status == 0
    assert b"endpoint-load-metrics-bin" in stream.headers  # the gateway's own, added
    wire = sum(entry_size(k.decode(), v.decode()) for k, v in stream.fields)
    print(f"headers and trailers on the wire: {wire} bytes (the worker's: {WORKER_PADS * 256})")
    assert wire < SOFT_LIMIT  # both blocks together
    per_call = WORKER_PADS - KEPT_PADS
    counted = samples(scrape(gw), DROPPED)
    assert counted[labels(kind="trailers")] == 4 * per_call
    assert counted[labels(kind="headers")] == 0
    # Logged as the cut was made, before the answer's trailers went out.
    (line, *_) = logged(gw, "relayed_metadata_dropped")
    assert (line["kind"], line["dropped"], line["kept"]) == ("trailers", per_call, KEPT_PADS)
    assert line["worker"] == worker.address


async def test_a_workers_big_response_headers_are_cut_as_well(
    gw: Child, client: aio.Channel
) -> None:
    messages, answer = await generate(client, ("x-header-bytes", str(WORKER_BYTES)))
    assert not isinstance(answer, aio.AioRpcError), answer
    assert len(messages) == MESSAGES
    headers, _ = answer
    assert padded(headers) == [f"x-pad-{i:03d}" for i in range(KEPT_PADS)]
    counted = samples(scrape(gw), DROPPED)
    assert counted[labels(kind="headers")] == WORKER_PADS - KEPT_PADS


async def test_an_ok_answer_carries_none_of_a_workers_failure_keys(
    gw: Child, client: aio.Channel
) -> None:
    extra = ("x-trailer-extra", "x-http-status=503,grpc-status-details-bin=junk,x-kept=1")
    messages, answer = await generate(client, extra)
    assert not isinstance(answer, aio.AioRpcError), answer
    assert len(messages) == MESSAGES
    _, trailing = answer
    assert trailing.get("x-kept") == "1"
    assert "x-http-status" not in trailing and "grpc-status-details-bin" not in trailing
    stream = await raw_call(gw.port, (extra[0].encode(), extra[1].encode()))
    assert stream.status == 0 and b"x-http-status" not in stream.headers
    # A failure relays the worker's x-http-status; grpc's own keys are never relayed.
    messages, error = await generate(client, extra, ("x-fail-code", "INTERNAL"))
    assert isinstance(error, aio.AioRpcError) and error.code() is grpc.StatusCode.INTERNAL
    assert len(messages) == MESSAGES
    assert trailers(error)["x-http-status"] == "503"
    assert "grpc-status-details-bin" not in trailers(error)
    assert samples(scrape(gw), DROPPED)[labels(kind="trailers")] == 0
