"""Tracing end to end, real processes: a gateway configured only by the standard OTEL_*
variables exports to an OTLP/gRPC receiver; a grpcurl call with a `traceparent` is
continued, and the worker gets the context of the gateway's CLIENT span."""

from __future__ import annotations

import asyncio
import json

from opentelemetry.proto.trace.v1 import trace_pb2

from gateway_sim.launch import SERVE_ARGS, START_S, Child, start, worker_url
from tests.support.launch import Launcher, grpcurl
from tests.support.tracing import CLIENT_SPAN, TRACE_ID, TRACEPARENT, attributes, receiver
from tests.support.waits import until


async def test_a_gateway_traced_by_otel_variables_continues_a_grpcurl_calls_trace(
    sim: Launcher, processes: list[Child]
) -> None:
    worker = sim("--runtime", "sglang", "--model", "m")
    async with receiver() as (kept, _, port):
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_SERVICE_NAME": "gw-e2e",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        gw = start(
            [*SERVE_ARGS, "--worker", worker_url(worker, model="m", runtime="sglang")],
            env=env,
            timeout=START_S,
        )
        processes.append(gw)
        body = json.dumps(
            {"request_id": "t1", "tokenized": {"input_ids": [1, 2, 3]}, "stream": True}
        )
        done = await asyncio.to_thread(
            grpcurl,
            "-plaintext",
            "-v",
            "-H",
            "x-model-id: m",
            "-H",
            f"traceparent: {TRACEPARENT}",
            "-d",
            body,
            gw.address,
            "sglang.grpc.scheduler.SglangScheduler/Generate",
        )
        assert done.returncode == 0, done.stderr
        echoed = next(
            line.split(": ", 1)[1]
            for line in done.stdout.splitlines()
            if line.startswith("x-sim-traceparent: ")
        )
        await until(lambda: bool(kept.named("upstream") and kept.named("sglang")), within_s=15)
    (server,) = kept.named("sglang")
    (leg,) = kept.named("upstream")
    assert server.trace_id.hex() == leg.trace_id.hex() == TRACE_ID
    assert server.parent_span_id.hex() == CLIENT_SPAN
    assert server.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert echoed == f"00-{TRACE_ID}-{leg.span_id.hex()}-01"
    assert attributes(server)["gen_ai.response.id"] == "t1"
