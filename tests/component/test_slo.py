"""Latency objectives end to end, in process (`x-slo-ttft-ms`, `x-slo-tpot-ms`): a value
that names no time is INVALID_ARGUMENT before anything is placed; once the workers'
models are warm, a sheddable call (class `batch`) no worker is predicted to serve in time
is refused RESOURCE_EXHAUSTED SLO_UNATTAINABLE with a time to retry, a call of another
class with the same objective is served, and a call whose objective the fast worker
meets goes there, even when the slow one holds its prompt; the outcomes are counted, and
every in-flight count and backlog returns to zero."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.core.roles import Role
from gateway.placement.policies.predicted_latency import EXPLORE_EVERY
from gateway.upstream.latency import MIN_SEEN
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.helpers import rich_status
from tests.support.inproc import client, gateway, idle, pd_urls, recorded, sim, worker
from tests.support.latency import warm_up
from tests.support.waits import until


def slo_md(**headers: str) -> tuple[tuple[str, str | bytes], ...]:
    return (*model_md("m"), *((k.replace("_", "-"), v) for k, v in headers.items()))


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-slo-ttft-ms", "0"),
        ("x-slo-ttft-ms", "-5"),
        ("x-slo-ttft-ms", "soon"),
        ("x-slo-ttft-ms", "nan"),
        ("x-slo-tpot-ms", "inf"),
        ("x-slo-tpot-ms", "3600001"),
        ("x-slo-tpot-ms", "1" * 40),
    ],
)
async def test_an_objective_that_names_no_time_is_invalid(header: str, value: str) -> None:
    async with (
        sim("--model", "m") as one,
        gateway(one.url(model="m", runtime="sglang"), default_policy="predicted_latency") as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        records = recorded(gw)
        _, error = await collect(
            stub.Generate(sgl_generate("bad"), metadata=(*model_md("m"), (header, value)))
        )
        assert isinstance(error, aio.AioRpcError)
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert header in (error.details() or "")
        _, details = rich_status(error)
        (violation,) = details["BadRequest"].field_violations
        assert violation.field == header
        await idle(gw)
        # The record is observed after the answer is on its way: wait for it (a clean
        # clone's run once asserted before it came).
        await until(lambda: len(records) == 1, what="the refused call's record")
        assert records[-1].attempts == 0


async def test_sheddable_calls_that_cannot_be_served_in_time_are_refused() -> None:
    async with (
        sim("--model", "m", "--ttft-ms", "4", "--token-ms", "2") as fast,
        sim("--model", "m", "--ttft-ms", "4", "--token-ms", "2", "--speed", "0.1") as slow,
        gateway(
            fast.url(model="m", runtime="sglang"),
            slow.url(model="m", runtime="sglang"),
            default_policy="predicted_latency",
            retry_after_ms=100,
        ) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        records = recorded(gw)
        models = [worker(gw, w).latency for w in (fast, slow)]
        await warm_up(stub, lambda: min(m.seen for m in models) >= MIN_SEEN, 20 * MIN_SEEN)
        fast_s = worker(gw, fast).latency.predict(3, 0, 0)
        slow_s = worker(gw, slow).latency.predict(3, 0, 0)
        assert fast_s is not None and slow_s is not None and slow_s > 3 * fast_s
        # Shed: a batch call asking for a tenth of what even the fast worker takes.
        hopeless = f"{fast_s * 100:.3f}"
        shed = 0
        for i in range(4):  # on every turn: shedding comes before exploring
            _, error = await collect(
                stub.Generate(
                    sgl_generate(f"s{i}"),
                    metadata=slo_md(x_slo_ttft_ms=hopeless, x_priority="batch"),
                )
            )
            assert error is not None
            shed += 1
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "predicted to meet" in (error.details() or "")
            _, details = rich_status(error)
            assert details["ErrorInfo"].reason == "SLO_UNATTAINABLE"
            assert details["RetryInfo"].retry_delay.ToMilliseconds() >= 100
        # Not sheddable: served (where it has the most headroom), counted as missed.
        for i in range(3):
            _, error = await collect(
                stub.Generate(sgl_generate(f"k{i}"), metadata=slo_md(x_slo_ttft_ms=hopeless))
            )
            assert error is None
        # In reach of the fast worker only: it goes there, and meets it.
        reachable = f"{(fast_s + slow_s) / 2 * 1000:.3f}"
        met = []
        for i in range(6):
            _, error = await collect(
                stub.Generate(
                    sgl_generate(f"f{i}"),
                    metadata=slo_md(
                        x_slo_ttft_ms=reachable, x_slo_tpot_ms="1000", x_priority="batch"
                    ),
                )
            )
            assert error is None
            met.append(records[-1].worker)
        assert met.count(fast.address) >= 5  # one may explore
        await idle(gw)
        assert worker(gw, fast).prefill_backlog == worker(gw, slow).prefill_backlog == 0
        sample = gw.parts.metrics.prometheus.get_sample_value

        def counted(klass: str, outcome: str) -> float:
            labels = {"model": "m", "class": klass, "outcome": outcome}
            return sample("gateway_slo_calls_total", labels) or 0.0

        assert counted("batch", "shed") == shed
        assert counted("", "missed") == 3  # not sheddable: served, late
        assert counted("batch", "met") + counted("batch", "missed") == 6 + 4 - shed
        assert sample("gateway_worker_ttft_prediction_error_count", {"worker": fast.address})
        assert all(r.attempts == 0 for r in records if r.verdict is not None)


async def test_pd_legs_go_by_time_to_first_token_and_by_pace() -> None:
    """Two prefills (one ten times slower) and two decodes (one ten times slower per
    token): once warm, the prefill leg goes where the first token comes sooner and the
    decode leg where tokens come faster; a sheddable call asking a pace no decode is
    predicted to keep is refused on the decode leg."""
    async with (
        sim("--role", "prefill", "--model", "m", "--ttft-ms", "3") as fast_p,
        sim("--role", "prefill", "--model", "m", "--ttft-ms", "3", "--speed", "0.1") as slow_p,
        sim("--role", "decode", "--model", "m", "--token-ms", "2") as fast_d,
        sim("--role", "decode", "--model", "m", "--token-ms", "2", "--speed", "0.1") as slow_d,
        gateway(
            *pd_urls(fast_p, fast_d),
            *pd_urls(slow_p, slow_d),
            default_policy="predicted_latency",
        ) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        records = recorded(gw)
        models = [worker(gw, w).latency for w in (fast_p, slow_p, fast_d, slow_d)]
        await warm_up(
            stub,
            lambda: (
                min(m.seen for m in models[:2]) >= MIN_SEEN
                and all(m.predict_pace(1) is not None for m in models[2:])
            ),
            40 * MIN_SEEN,
        )
        warm = len(records)
        for i in range(EXPLORE_EVERY):
            request = sgl_generate(f"r{i}", tokens=6)
            _, error = await collect(stub.Generate(request, metadata=slo_md()))
            assert error is None
        legs = [r.legs for r in records[warm:]]
        assert sum(leg[Role.PREFILL] == [fast_p.address] for leg in legs) >= EXPLORE_EVERY - 2
        assert sum(leg[Role.DECODE] == [fast_d.address] for leg in legs) >= EXPLORE_EVERY - 2
        fast_pace, slow_pace = models[2].predict_pace(1), models[3].predict_pace(1)
        assert fast_pace is not None and slow_pace is not None and slow_pace > 3 * fast_pace
        hopeless = f"{fast_pace * 100:.3f}"  # a tenth of the fast decode's pace
        for i in range(4):  # on every turn: shedding comes before exploring
            request = sgl_generate(f"s{i}", tokens=6)
            md = slo_md(x_slo_tpot_ms=hopeless, x_priority="batch")
            _, error = await collect(stub.Generate(request, metadata=md))
            assert error is not None
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            _, details = rich_status(error)
            assert details["ErrorInfo"].reason == "SLO_UNATTAINABLE"
            assert details["ErrorInfo"].metadata["leg"] == "decode"
        await idle(gw)
        assert all(worker(gw, w).prefill_backlog == 0 for w in (fast_p, slow_p, fast_d, slow_d))
