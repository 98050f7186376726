"""OpenTelemetry traces, exported over OTLP/gRPC to a real receiver (the collector's
`TraceService/Export` from opentelemetry-proto, served here): a call continues its
client's trace; each upstream leg and attempt is a CLIENT span whose context the worker
received; a collector that goes away costs the calls nothing and its spans are counted
as dropped."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any, cast

from opentelemetry.proto.trace.v1 import trace_pb2

from gateway_sim.client import collect, model_md, sgl_generate, sgl_grpc
from tests.support.inproc import Sim, client, gateway, idle, pd_urls, recorded, sim
from tests.support.tracing import CLIENT_SPAN, TRACE_ID, TRACEPARENT, attributes, receiver
from tests.support.waits import until

INFO = ("--log-level", "info")


def tracing(port: int, **extra: Any) -> dict[str, Any]:
    return {"tracing": {"endpoint": f"http://127.0.0.1:{port}", "schedule_delay_ms": 20, **extra}}


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def sim_traceparents() -> Iterator[dict[str, str]]:
    """The traceparent each simulated worker received, by worker name (the sim logs it
    on its own logger, at info: start the sims with `--log-level info`)."""
    seen: dict[str, str] = {}
    kept = Kept()
    logger = logging.getLogger("gateway_sim")
    logger.addHandler(kept)
    try:
        yield seen
    finally:
        logger.removeHandler(kept)
        for entry in kept.records:
            if entry.msg == "traceparent %s %s":
                # gateway_sim logs `traceparent %s %s` with its name and the value it got.
                name, value = cast("tuple[str, str]", entry.args)
                seen[name] = value


async def test_a_pd_call_continues_the_clients_trace_with_a_client_span_per_leg() -> None:
    async with (
        receiver() as (kept, _, port),
        sim("--role", "prefill", "--model", "m", "--name", "p", *INFO) as prefill,
        sim("--role", "decode", "--model", "m", "--name", "d", *INFO) as decode,
        gateway(*pd_urls(prefill, decode), **tracing(port)) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        with sim_traceparents() as received:
            metadata = model_md("m", ("traceparent", TRACEPARENT))
            call = stub.Generate(sgl_generate("pd-1", tokens=4), metadata=metadata)
            messages, error = await collect(call)
            assert error is None and len(messages) == 5
            await idle(gw)
        await until(lambda: len(kept.named("upstream")) == 2 and bool(kept.named("sglang")))
    (server,) = kept.named("sglang")
    legs = {attributes(s)["gateway.leg"]: s for s in kept.named("upstream")}
    (placement,) = kept.named("placement")
    assert {s.trace_id.hex() for s in kept.spans} == {TRACE_ID}
    assert server.parent_span_id.hex() == CLIENT_SPAN
    assert server.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert set(legs) == {"prefill", "decode"}
    for leg, name in (("prefill", "p"), ("decode", "d")):
        span = legs[leg]
        assert span.kind == trace_pb2.Span.SPAN_KIND_CLIENT
        assert span.parent_span_id == server.span_id
        # The worker got this span as its parent: an engine that traces joins here.
        assert received[name] == f"00-{TRACE_ID}-{span.span_id.hex()}-01"
        assert attributes(span)["gateway.outcome"] == "OK"
    assert placement.parent_span_id == server.span_id
    found = attributes(server)
    assert found["gen_ai.operation.name"] == "text_completion"
    assert found["gen_ai.request.model"] == "m"
    assert found["gen_ai.response.id"] == "pd-1"
    assert (found["gen_ai.usage.input_tokens"], found["gen_ai.usage.output_tokens"]) == (3, 4)
    assert found["rpc.grpc.status_code"] == 0 and found["gateway.attempts"] == 1
    assert attributes(placement)["gateway.workers"] == [prefill.address, decode.address]


async def test_a_retry_shows_as_two_attempt_spans_and_the_log_line_names_the_trace() -> None:
    async with (
        receiver() as (kept, _, port),
        sim("--model", "m", "--name", "good") as good,
        sim("--model", "m", "--name", "bad", "--fail-code", "UNAVAILABLE") as bad,
        gateway(_url(good), _url(bad), **tracing(port)) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        now = time.monotonic
        await until(lambda: all(w.available(now()) for w in gw.parts.fleet.registry))
        records = recorded(gw)
        # Round robin over the two: one of two calls goes to the bad one first.
        for i in range(2):
            _, error = await collect(stub.Generate(sgl_generate(f"r{i}"), metadata=model_md("m")))
            assert error is None
        await idle(gw)
        retried = next(r for r in records if r.retries == 1)
        trace_id = retried.trace_id
        assert trace_id is not None and retried.log_fields()["trace_id"] == trace_id

        def spans(prefix: str) -> list[trace_pb2.Span]:
            return [s for s in kept.named(prefix) if s.trace_id.hex() == trace_id]

        await until(lambda: len(spans("upstream")) == 2 and len(spans("sglang")) == 1)
    (server,) = spans("sglang")
    legs = sorted((attributes(s) for s in spans("upstream")), key=lambda a: a["gateway.attempt"])
    attempts = [(a["gateway.attempt"], a["gateway.worker"], a["gateway.outcome"]) for a in legs]
    assert attempts == [(1, bad.address, "UNAVAILABLE"), (2, good.address, "OK")]
    assert legs[1]["gateway.retry"] is True
    assert attributes(server)["gateway.retries"] == 1
    assert not server.parent_span_id  # no client traceparent: a new root trace
    placements = [attributes(s) for s in spans("placement")]
    assert [p["gateway.excluded_workers"] for p in placements] == [[], [bad.address]]


async def test_a_collector_that_goes_away_costs_the_calls_nothing_and_spans_count_as_dropped() -> (
    None
):
    async with (
        receiver() as (kept, collector, port),
        sim("--model", "m") as w,
        gateway(_url(w), **tracing(port, export_timeout_s=0.2)) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        sample = gw.parts.metrics.prometheus.get_sample_value
        _, error = await collect(stub.Generate(sgl_generate("before"), metadata=model_md("m")))
        assert error is None
        await until(lambda: (sample("gateway_trace_spans_exported_total") or 0) >= 3)
        await collector.stop(None)
        for i in range(20):
            _, error = await collect(stub.Generate(sgl_generate(f"r{i}"), metadata=model_md("m")))
            assert error is None
        await idle(gw)
        await until(lambda: (sample("gateway_trace_spans_dropped_total") or 0) >= 60, within_s=20)
        assert kept.named("sglang")  # the first call's spans went through


def _url(worker: Sim) -> str:
    return worker.url(model="m", runtime="sglang")


async def test_what_a_client_names_is_kept_bounded_in_its_spans() -> None:
    async with (
        receiver() as (kept, _, port),
        sim("--model", "m") as w,
        gateway(_url(w), **tracing(port)) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        _, error = await collect(stub.Generate(sgl_generate("x" * 100_000), metadata=model_md("m")))
        assert error is None
        await idle(gw)
        await until(lambda: bool(kept.named("sglang")))
    (server,) = kept.named("sglang")
    assert attributes(server)["gen_ai.response.id"] == "x" * 256
