"""Front-door limits in process: the stream idle timeout, keepalive that a long silent
call survives, and the transport options the main port runs with."""

from __future__ import annotations

import time
from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.app.transport import server_options
from gateway.config import build_config
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.inproc import client, gateway, idle, sim, worker

M = model_md("m")


async def test_a_stream_with_nothing_moving_is_ended_and_its_upstream_cancelled(
    strict: bool,
) -> None:
    """Ended by the idle timeout (its message says so; the worker would answer only after
    30 s), never before it, within 1 s in the timing tier; the worker call is cancelled."""
    settings: dict[str, Any] = {"limits.stream_idle_timeout_s": 0.2}
    async with (
        sim("--model", "m", "--ttft-ms", "30000") as w,
        gateway(w.url(model="m", runtime="sglang"), **settings) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        started = time.monotonic()
        _, error = await collect(stub.Generate(sgl_generate("stuck"), metadata=M))
        elapsed = time.monotonic() - started
        assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.details() == "Stream idle for 0.2 s: no message moved either way"
        assert elapsed >= 0.2
        if strict:
            assert elapsed < 1.0
        await idle(gw)
        # A stream whose messages keep coming is never idle, however long it lasts.
        moving = model_md("m", ("x-sim-ttft-ms", "0"), ("x-sim-token-ms", "60"))
        messages, error = await collect(stub.Generate(sgl_generate("slow", 12), metadata=moving))
        assert error is None and len(messages) == 13
        assert worker(gw, w).outlier.state.value == "closed"


async def test_keepalive_pings_do_not_end_a_long_silent_call() -> None:
    """Pings every 0.2 s while the worker thinks for 2 s: the worker accepts them (an
    engine must), so the call ends with its answer, not GOAWAY too_many_pings."""
    keepalive: dict[str, Any] = {
        "upstream.keepalive_time_s": 0.2,
        "upstream.keepalive_timeout_s": 1,
    }
    async with (
        sim("--model", "m", "--ttft-ms", "2000") as w,
        gateway(
            w.url(model="m", runtime="sglang"),
            **keepalive,
        ) as gw,
        client(gw) as ch,
    ):
        messages, error = await collect(
            sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate("think"), metadata=M)
        )
        assert error is None and len(messages) == 5


def test_the_main_port_runs_with_the_configured_transport_limits() -> None:
    config = build_config(
        {
            "limits": {
                "max_concurrent_streams": 8,
                "connection_idle_timeout_s": 30,
                "max_connection_age_s": 0,
                "max_connections": 100,
            },
            "max_message_bytes": 1024,
        }
    )
    assert dict(server_options(config)) == {
        "grpc.max_send_message_length": 1024,
        "grpc.max_receive_message_length": 1024,
        "grpc.so_reuseport": 0,
        "grpc.max_concurrent_streams": 8,
        "grpc.max_connection_idle_ms": 30_000,
        "grpc.max_allowed_incoming_connections": 100,
        "grpc.http2.bdp_probe": 0,
        "grpc.http2.lookahead_bytes": 65536,
    }
    default = dict(server_options(build_config()))
    assert default["grpc.max_connection_age_ms"] == 3_600_000
    assert default["grpc.max_connection_age_grace_ms"] == 600_000
    assert default["grpc.max_receive_message_length"] == 64 * 1024 * 1024
