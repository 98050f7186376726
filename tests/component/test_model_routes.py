"""Model aliases, in process: a call for `chat` goes to one of its targets by weight, is
placed exactly as a call for that target (its own workers, its own PD pairs), skips a
target with no servable worker, and follows a route set through the admin API at once."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2

from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway.app.server import Gateway
from gateway.services.health import NOT_SERVING, SERVING
from gateway_sim.client import (
    closed_port,
    collect,
    dead_worker_url,
    is_healthy,
    model_md,
    sgl,
    sgl_grpc,
)
from tests.support.inproc import Sim, client, gateway, idle, pd_urls, recorded, sim
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)

CALLS = 40


def split(**weights: int) -> dict[str, Any]:
    return {"chat": {"route": [{"model": m, "weight": w} for m, w in weights.items()]}}


@contextlib.asynccontextmanager
async def two_versions(**weights: int) -> AsyncIterator[tuple[Sim, Sim, Gateway]]:
    """A worker of v2 and one of v3 behind a gateway splitting alias `chat` over them."""
    async with (
        sim("--model", "v2") as v2,
        sim("--model", "v3") as v3,
        gateway(
            v2.url(model="v2", runtime="sglang"),
            v3.url(model="v3", runtime="sglang"),
            models=split(**weights),
        ) as gw,
    ):
        yield v2, v3, gw


def pd_pair(prefill: Sim, decode: Sim, model: str) -> list[str]:
    """A prefill and a decode of one model (its version), roles given explicitly."""
    urls = pd_urls(prefill, decode)
    return [url.replace("model=m", f"model={model}") for url in urls]


def request(i: int) -> Any:
    return sgl.GenerateRequest(
        request_id=f"r{i}",
        tokenized=sgl.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=sgl.SamplingParams(max_new_tokens=2),
        stream=True,
    )


async def generate(gw: Gateway, count: int, *extra: tuple[str, str]) -> None:
    """`count` calls for the alias, each answered without an error."""
    async with client(gw) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(count):
            messages, error = await collect(
                stub.Generate(request(i), metadata=model_md("chat", *extra))
            )
            assert error is None, error
            assert messages


def targets(records: list[Any]) -> list[str]:
    return [r.target for r in records if r.rpc == "Generate"]


async def test_a_split_sends_calls_to_both_targets_and_logs_the_target() -> None:
    async with (
        two_versions(v2=50, v3=50) as (v2, v3, gw),
    ):
        seen = recorded(gw)
        await generate(gw, CALLS)
        await until(lambda: len(targets(seen)) == CALLS)
        assert set(targets(seen)) == {"v2", "v3"}
        assert {r.model for r in seen} == {"chat"}
        by_worker = {r.target: r.worker for r in seen}
        assert by_worker == {"v2": v2.address, "v3": v3.address}  # never the other's
        fields = seen[0].log_fields()
        assert fields["model"] == "chat" and fields["target"] in ("v2", "v3")
        await idle(gw)
        prometheus = gw.parts.metrics.prometheus
        counts = {
            t: prometheus.get_sample_value(
                "gateway_route_decisions_total", {"alias": "chat", "target": t}
            )
            for t in ("v2", "v3")
        }
        assert counts["v2"] is not None and counts["v3"] is not None
        assert counts["v2"] + counts["v3"] == CALLS
        served = prometheus.get_sample_value(
            "gateway_requests_total",
            {
                "model": "v3",
                "service": "sglang.grpc.scheduler.SglangScheduler",
                "rpc": "Generate",
                "code": "OK",
            },
        )
        assert served == counts["v3"]  # call series: the target it ran on


async def test_a_routing_key_keeps_its_target() -> None:
    async with (
        two_versions(v2=50, v3=50) as (_v2, _v3, gw),
    ):
        seen = recorded(gw)
        await generate(gw, 10, ("x-routing-key", "user-7"))
        await until(lambda: len(targets(seen)) == 10)
        assert len(set(targets(seen))) == 1


async def test_with_every_v3_worker_down_every_call_goes_to_v2() -> None:
    with contextlib.closing(closed_port()) as dead:
        async with (
            sim("--model", "v2") as v2,
            gateway(
                v2.url(model="v2", runtime="sglang"),
                dead_worker_url(dead, model="v3", runtime="sglang"),
                ready=False,
                models=split(v2=10, v3=90),
            ) as gw,
        ):
            await until(lambda: gw.parts.placer.servable("v2"))
            seen = recorded(gw)
            await generate(gw, CALLS)
            await until(lambda: len(targets(seen)) == CALLS)
            assert set(targets(seen)) == {"v2"}
            assert gw.parts.health.status("models/chat") == SERVING
            assert gw.parts.health.status("models/v3") == NOT_SERVING


async def test_with_no_target_servable_the_verdict_names_the_alias() -> None:
    with contextlib.closing(closed_port()) as dead:
        async with (
            gateway(
                dead_worker_url(dead, model="v3", runtime="sglang"),
                ready=False,
                models={"v2": {}, **split(v2=10, v3=90)},
            ) as gw,
            client(gw) as ch,
        ):
            stub = sgl_grpc.SglangSchedulerStub(ch)
            _, error = await collect(stub.Generate(request(1), metadata=model_md("chat")))
            assert error is not None
            assert error.code() is grpc.StatusCode.UNAVAILABLE  # v3's: workers unavailable
            assert "Model 'chat' routes to v2, v3" in str(error.details())
            assert gw.parts.health.status("models/chat") == NOT_SERVING
            assert not await is_healthy(f"127.0.0.1:{gw.port}", "chat")


async def test_pd_targets_never_pair_across_versions() -> None:
    async with (
        sim("--role", "prefill", "--model", "v2") as p2,
        sim("--role", "decode", "--model", "v2") as d2,
        sim("--role", "prefill", "--model", "v3") as p3,
        sim("--role", "decode", "--model", "v3") as d3,
        gateway(*pd_pair(p2, d2, "v2"), *pd_pair(p3, d3, "v3"), models=split(v2=50, v3=50)) as gw,
    ):
        seen = recorded(gw)
        await generate(gw, CALLS)
        await until(lambda: len(targets(seen)) == CALLS)
        own = {"v2": {p2.address, d2.address}, "v3": {p3.address, d3.address}}
        for record in seen:
            called = {w for workers in record.legs.values() for w in workers}
            assert called == own[record.target or ""], record.log_fields()
        assert set(targets(seen)) == {"v2", "v3"}


async def test_health_of_the_alias_follows_its_targets() -> None:
    async with (
        sim("--model", "v2") as v2,
        gateway(v2.url(model="v2", runtime="sglang"), models=split(v2=1)) as gw,
        client(gw) as ch,
    ):
        assert gw.parts.health.status("models/chat") == SERVING
        health = await ch.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )(health_pb2.HealthCheckRequest(service="models/chat"))
        assert health.status == SERVING
        assert await is_healthy(f"127.0.0.1:{gw.port}", "chat")


async def test_set_route_through_the_admin_api_takes_effect_at_once() -> None:
    async with (
        two_versions(v2=100, v3=0) as (_v2, _v3, gw),
        aio.insecure_channel(f"127.0.0.1:{gw.admin_port}") as admin_channel,
    ):
        admin = admin_pb2_grpc.AdminServiceStub(admin_channel)
        seen = recorded(gw)
        await generate(gw, 5)
        await until(lambda: len(targets(seen)) == 5)
        assert set(targets(seen)) == {"v2"}
        answer = await admin.SetRoute(
            pb.SetRouteRequest(
                alias="chat",
                targets=[
                    pb.RouteTarget(model="v2", weight=0),
                    pb.RouteTarget(model="v3", weight=1),
                ],
            )
        )
        assert [(t.model, t.weight) for t in answer.route.targets] == [("v2", 0), ("v3", 1)]
        seen.clear()
        await generate(gw, 5)
        await until(lambda: len(targets(seen)) == 5)
        assert set(targets(seen)) == {"v3"}
        listed = await admin.ListRoutes(pb.ListRoutesRequest())
        assert [r.alias for r in listed.routes] == ["chat"]
        for bad, code in (
            (
                pb.SetRouteRequest(alias="v2", targets=[pb.RouteTarget(model="v3", weight=1)]),
                grpc.StatusCode.NOT_FOUND,
            ),
            (
                pb.SetRouteRequest(alias="chat", targets=[pb.RouteTarget(model="v3", weight=0)]),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            (
                pb.SetRouteRequest(alias="chat", targets=[pb.RouteTarget(model="zz", weight=1)]),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ):
            with pytest.raises(aio.AioRpcError) as caught:
                await admin.SetRoute(bad)
            assert caught.value.code() is code
