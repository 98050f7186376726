"""OpenRcaService/StreamCoreMetrics on the main port, read by a grpc client: reports at
the interval asked for (never under the floor), the load they show, the cap on streams,
and streams ending when the gateway drains."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.orca.report import IN_FLIGHT
from gateway.orca.v3 import orca_pb2, orca_pb2_grpc
from gateway.orca.v3.orca_load_report_pb2 import OrcaLoadReport
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.inproc import client, gateway, sim
from tests.support.waits import WAIT_S, until

M = model_md("m")


def ask(interval_ms: int) -> orca_pb2.OrcaLoadReportRequest:
    return orca_pb2.OrcaLoadReportRequest(
        report_interval=Duration(seconds=interval_ms // 1000, nanos=interval_ms % 1000 * 10**6)
    )


async def arrivals(call: Any, count: int) -> list[tuple[float, OrcaLoadReport]]:
    """The first `count` reports of a stream, each with the loop time it arrived at; then
    the stream is cancelled."""
    got: list[tuple[float, OrcaLoadReport]] = []
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(WAIT_S):
        async for report in call:
            got.append((loop.time(), report))
            if len(got) == count:
                break
    call.cancel()
    return got


def gaps(got: list[tuple[float, OrcaLoadReport]]) -> list[float]:
    return [b[0] - a[0] for a, b in itertools.pairwise(got)]


async def test_reports_come_at_the_interval_asked_for_never_under_the_floor(strict: bool) -> None:
    """Never sooner than asked (or than the floor); late only by a busy machine's jitter:
    the interval asked for (300 ms) is kept apart from the floor (100 ms) by their
    quickest gaps (lateness only lengthens a gap, or shortens the next), and, in the
    timing tier, each mean gap is within 50 % of its interval."""
    settings: dict[str, Any] = {"orca.min_interval_s": 0.1}
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), **settings) as gw,
        client(gw) as ch,
    ):
        orca = orca_pb2_grpc.OpenRcaServiceStub(ch)
        asked = await arrivals(orca.StreamCoreMetrics(ask(300)), 5)
        floored = await arrivals(orca.StreamCoreMetrics(ask(10)), 5)  # under the floor
        print("300 ms asked:", [round(g, 3) for g in gaps(asked)])
        print("10 ms asked, 100 ms floor:", [round(g, 3) for g in gaps(floored)])
        assert all(g >= 0.27 for g in gaps(asked)), gaps(asked)
        assert all(g >= 0.09 for g in gaps(floored)), gaps(floored)
        # 3 on time; 1 for an interval that does not follow the one asked for.
        assert min(gaps(asked)) > 1.5 * min(gaps(floored)), (gaps(asked), gaps(floored))
        if strict:
            assert sum(gaps(asked)) / 4 < 0.45 and sum(gaps(floored)) / 4 < 0.2
        await until(lambda: gw.parts.orca.streams == 0)  # a client that leaves frees its slot


async def test_a_report_shows_the_calls_in_flight() -> None:
    settings: dict[str, Any] = {"orca.min_interval_s": 0.1}
    async with (
        sim("--model", "m", "--ttft-ms", "30000") as w,
        gateway(w.url(model="m", runtime="sglang"), **settings) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        held = [stub.Generate(sgl_generate(f"held-{i}"), metadata=M) for i in range(2)]
        await until(lambda: gw.parts.admission.active == 2)
        orca = orca_pb2_grpc.OpenRcaServiceStub(ch)
        got = await arrivals(orca.StreamCoreMetrics(ask(100)), 13)  # over a second
        last = got[-1][1]
        assert last.named_metrics[IN_FLIGHT] == 2
        # Two calls in flight the whole window, of 4096.
        assert abs(last.application_utilization - 2 / 4096) < 0.1 * 2 / 4096
        assert last.cpu_utilization > 0
        for call in held:
            call.cancel()


async def test_streams_are_capped_and_end_when_the_gateway_drains() -> None:
    settings: dict[str, Any] = {"orca.max_streams": 1}
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), **settings) as gw,
        client(gw) as ch,
    ):
        orca = orca_pb2_grpc.OpenRcaServiceStub(ch)
        first = orca.StreamCoreMetrics(ask(1000))
        assert await first.read() is not None
        reports, error = await collect(orca.StreamCoreMetrics(ask(1000)))
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not reports
        gw.parts.orca.close_streams()  # what drain_and_stop does as it stops
        async with asyncio.timeout(WAIT_S):
            assert await first.read() is grpc.aio.EOF
        assert await first.code() is grpc.StatusCode.OK
        _, error = await collect(orca.StreamCoreMetrics(ask(1000)))
        assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
        # The engine calls are unaffected.
        messages, error = await collect(stub_generate(ch))
        assert error is None and messages


def stub_generate(ch: grpc.aio.Channel) -> Any:
    return sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate("after"), metadata=M)
