"""Every path through the one upstream call, in process: reservations taken at placement,
headers relayed for every hand-off, attempts apart from legs and targets, encoders kept
out of engine RPCs, listener failures kept out of requests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from structlog.testing import capture_logs

from gateway.upstream.registry import FleetEvent
from gateway.upstream.signals.outlier import OutlierState
from gateway_sim.client import collect, model_md, sgl_generate, vllm_generate
from tests.support.inproc import client, gateway, idle, sim, worker
from tests.support.waits import until

M = model_md("m")


def requests(logs: Sequence[Mapping[str, Any]], rpc: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e.get("event") == "request" and e.get("rpc") == rpc]


async def test_vllm_pd_reserves_the_decode_when_it_places_the_prefill() -> None:
    """The decode is counted in flight (and would take a half-open trial) from placement on,
    not once the prefill has finished: the next placement must see it busy."""
    async with (
        sim("--runtime", "vllm", "--role", "prefill", "--model", "m", "--ttft-ms", "30000") as p,
        sim("--runtime", "vllm", "--role", "decode", "--model", "m") as d,
        gateway(
            p.url(model="m", runtime="vllm", role="prefill"),
            d.url(model="m", runtime="vllm", role="decode"),
        ) as gw,
    ):
        prefill, decode = worker(gw, p), worker(gw, d)
        async with client(gw) as ch:
            call = vllm_grpc.VllmEngineStub(ch).Generate(vllm_generate("r1"), metadata=M)
            await until(lambda: prefill.inflight == 1)
            assert decode.inflight == 1  # the prefill is still computing
            assert [h.worker for h in gw.parts.inflight.holders("r1")] == [prefill]
            call.cancel()
        await idle(gw)
        assert decode.outlier.state is OutlierState.CLOSED


async def test_an_unused_reservation_is_released_with_its_half_open_trial() -> None:
    """A prefill that hands over no KV params fails the request before the decode is
    called: the decode's reservation, and the half-open trial it took, go back."""
    async with (
        sim("--runtime", "vllm", "--role", "prefill", "--model", "m", "--omit-kv-params") as p,
        sim("--runtime", "vllm", "--role", "decode", "--model", "m") as d,
        gateway(
            p.url(model="m", runtime="vllm", role="prefill"),
            d.url(model="m", runtime="vllm", role="decode"),
        ) as gw,
    ):
        decode = worker(gw, d)
        decode.outlier.state = OutlierState.HALF_OPEN  # the next request is its one trial
        async with client(gw) as ch:
            _, error = await collect(
                vllm_grpc.VllmEngineStub(ch).Generate(vllm_generate("r1"), metadata=M)
            )
        assert error is not None and error.code() is grpc.StatusCode.INTERNAL
        assert error.details() == (
            f"prefill worker {p.address}: returned no kv_transfer_params; "
            "the decode cannot fetch the KV cache"
        )
        await idle(gw)
        assert decode.outlier.trial_in_flight is False
        assert decode.outlier.admits(0.0)


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
async def test_pd_streams_relay_the_decode_workers_headers(runtime: str) -> None:
    role_flags = ("--runtime", runtime, "--model", "m")
    async with (
        sim("--role", "prefill", "--name", "the-prefill", *role_flags) as p,
        sim("--role", "decode", "--name", "the-decode", *role_flags) as d,
    ):
        prefill_url = p.url(model="m", runtime=runtime, role="prefill")
        if runtime == "sglang":
            prefill_url += f"&bootstrap_port={p.side['bootstrap']}"
        async with (
            gateway(prefill_url, d.url(model="m", runtime=runtime, role="decode")) as gw,
            client(gw) as ch,
        ):
            if runtime == "sglang":
                call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate("r1"), metadata=M)
            else:
                call = vllm_grpc.VllmEngineStub(ch).Generate(vllm_generate("r1"), metadata=M)
            messages, error = await collect(call)
            assert error is None and len(messages) == 5
            headers = dict(await call.initial_metadata())
            assert headers["x-sim-worker"] == "the-decode"
            assert "x-sim-deadline-ms" in headers


async def test_epd_streams_relay_the_decode_workers_headers() -> None:
    async with (
        sim("--role", "prefill", "--model", "m", "--name", "the-prefill") as p,
        sim("--role", "decode", "--model", "m", "--name", "the-decode") as d,
        sim("--role", "encode", "--model", "m") as e,
    ):
        prefill_url = p.url(
            model="m",
            runtime="sglang",
            role="prefill",
            bootstrap_port=p.side["bootstrap"],
            embedding_port=p.side["embedding"],
        )
        async with (
            gateway(
                prefill_url,
                d.url(model="m", runtime="sglang", role="decode"),
                e.url(model="m", role="encode"),
            ) as gw,
            client(gw) as ch,
        ):
            request = sgl_generate("r1")
            request.mm_inputs.image_urls.append("http://img/cat.png")
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(request, metadata=M)
            with capture_logs() as logs:
                messages, error = await collect(call)
            assert error is None and len(messages) == 5
            assert dict(await call.initial_metadata())["x-sim-worker"] == "the-decode"
            stub = sgl_grpc.SglangSchedulerStub(ch)
            # Engine RPCs never reach the encoder, which does not speak the protocol.
            loads = await stub.GetLoads(sgl.GetLoadsRequest(), metadata=M)
            assert len(loads.loads) == 2
            for _ in range(4):
                info = await stub.GetModelInfo(sgl.GetModelInfoRequest(), metadata=M)
                assert info.served_model_name == "m"
        await idle(gw)
        (event,) = requests(logs, "Generate")
        assert event["legs"] == {
            "encode": [e.address],
            "prefill": [p.address],
            "decode": [d.address],
        }
        assert (event["attempts"], event["retries"], event["worker"]) == (1, 0, d.address)


async def test_attempts_count_placements_and_retries_only_retries() -> None:
    """One PD call, one GetLoads over both legs and one retried regular call: only the
    retry counts as a retry."""
    async with (
        sim("--role", "prefill", "--model", "pd") as p,
        sim("--role", "decode", "--model", "pd") as d,
        sim(
            "--model", "r", "--name", "bad", "--fail-code", "UNAVAILABLE", "--fail-after", "0"
        ) as bad,
        sim("--model", "r", "--name", "good") as good,
    ):
        prefill_url = p.url(
            model="pd", runtime="sglang", role="prefill", bootstrap_port=p.side["bootstrap"]
        )
        async with (
            gateway(
                prefill_url,
                d.url(model="pd", runtime="sglang", role="decode"),
                bad.url(model="r", runtime="sglang"),
                good.url(model="r", runtime="sglang"),
            ) as gw,
            client(gw) as ch,
        ):
            stub = sgl_grpc.SglangSchedulerStub(ch)
            with capture_logs() as logs:
                _, error = await collect(
                    stub.Generate(sgl_generate("pd-1"), metadata=model_md("pd"))
                )
                assert error is None
                loads = await stub.GetLoads(sgl.GetLoadsRequest(), metadata=model_md("pd"))
                assert len(loads.loads) == 2
                for i in range(2):  # round robin: at least one starts on the bad worker
                    _, error = await collect(
                        stub.Generate(sgl_generate(f"r-{i}"), metadata=model_md("r"))
                    )
                    assert error is None
            retries = gw.parts.metrics.prometheus.get_sample_value(
                "gateway_retries_total",
                {"model": "pd", "service": "sglang.grpc.scheduler.SglangScheduler"},
            )
            assert retries is None
            retried = gw.parts.metrics.prometheus.get_sample_value(
                "gateway_retries_total",
                {"model": "r", "service": "sglang.grpc.scheduler.SglangScheduler"},
            )
        pd_event = requests(logs, "Generate")[0]
        assert (pd_event["attempts"], pd_event["retries"]) == (1, 0)
        assert pd_event["legs"] == {"prefill": [p.address], "decode": [d.address]}
        (fan_out,) = requests(logs, "GetLoads")
        assert (fan_out["attempts"], fan_out["retries"]) == (0, 0)
        assert sorted(fan_out["targets"]) == sorted([p.address, d.address])
        regular = requests(logs, "Generate")[1:]
        retried_events = [e for e in regular if e["retries"] == 1]
        assert retried_events and retried == len(retried_events)
        for event in regular:
            if event["retries"] == 1:
                assert event["attempts"] == 2
                assert event["legs"] == {"regular": [bad.address, good.address]}
            else:
                assert (event["attempts"], event["legs"]) == (1, {"regular": [good.address]})
            assert event["worker"] == good.address


async def test_a_failing_fleet_listener_never_touches_the_request() -> None:
    """The request that ejects a worker publishes a fleet event from its own `finally`:
    a listener that raises there is logged, the other listeners still hear the event, and
    the request still leaves the abort table and its worker's in-flight count."""
    settings: dict[str, Any] = {"outlier_detection.failure_threshold": 1}
    async with (
        sim("--model", "m", "--fail-code", "INTERNAL", "--fail-after", "1") as w,
        gateway(w.url(model="m", runtime="sglang"), **settings) as gw,
    ):
        heard: list[FleetEvent] = []

        def broken(event: FleetEvent) -> None:
            raise RuntimeError("listener bug")

        gw.parts.fleet.registry.subscribe(broken)
        gw.parts.fleet.registry.subscribe(heard.append)
        async with client(gw) as ch:
            with capture_logs() as logs:
                messages, error = await collect(
                    sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate("r1"), metadata=M)
                )
        assert len(messages) == 1
        assert error is not None and error.code() is grpc.StatusCode.INTERNAL
        await idle(gw)
        assert [(e.kind, e.new) for e in heard] == [("outlier", "open")]
        failed = [e for e in logs if e["event"] == "fleet_listener_failed"]
        assert [(e["event"], e["worker"]) for e in failed] == [("fleet_listener_failed", w.address)]
        assert worker(gw, w).outlier.state is OutlierState.OPEN
