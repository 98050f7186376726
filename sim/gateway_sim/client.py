"""Client helpers for whatever talks to a gateway or a simulated worker from outside (the
end-to-end tests, the benchmarks, the attack scripts): generated stubs over grpc.aio,
requests, health and admin calls, bounded waits for a state."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.launch import Child

__all__ = ["sgl", "sgl_grpc", "vllm", "vllm_grpc"]

MAX = 256 * 1024 * 1024
SGL_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
SGL = f"/{SGL_SERVICE}/"  # a method's path: SGL + "Generate"
VLLM = f"/{VLLM_SERVICE}/"
POLL_S = 0.05
# Upper bound of every wait here for a state: a safety net, which only a hang reaches (on
# a machine busy with other work, a gateway noticing can take seconds).
WAIT_S = 30.0

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def channel(address: str) -> aio.Channel:
    return aio.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", MAX),
            ("grpc.max_receive_message_length", MAX),
            ("grpc.enable_retries", 0),
        ],
    )


def sgl_generate(request_id: str = "r1", tokens: int = 4, stream: bool = True, n: int = 1) -> Any:
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens, n=n),
        stream=stream,
    )


def vllm_generate(request_id: str = "r1", tokens: int = 4, stream: bool = True) -> Any:
    return vllm.GenerateRequest(
        request_id=request_id,
        tokenized=vllm.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vllm.SamplingParams(max_tokens=tokens),
        stream=stream,
    )


def model_md(model: str, *extra: tuple[str, str | bytes]) -> tuple[tuple[str, str | bytes], ...]:
    return (("x-model-id", model), *extra)


def trailers(error: aio.AioRpcError) -> dict[str, Any]:
    return {k: v for k, v in (error.trailing_metadata() or ())}


def write_config(directory: Path, data: dict[str, Any]) -> str:
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def stub_for(ch: aio.Channel, runtime: str = "sglang") -> Any:
    if runtime == "vllm":
        return vllm_grpc.VllmEngineStub(ch)
    return sgl_grpc.SglangSchedulerStub(ch)


def pb_for(runtime: str) -> Any:
    return vllm if runtime == "vllm" else sgl


def generate_for(runtime: str, request_id: str = "r1", tokens: int = 4, stream: bool = True) -> Any:
    if runtime == "vllm":
        return vllm_generate(request_id, tokens, stream)
    return sgl_generate(request_id, tokens, stream)


async def collect(call: Any) -> tuple[list[Any], aio.AioRpcError | None]:
    """Read a server stream to its end: the messages and the error that ended it, if any."""
    messages: list[Any] = []
    try:
        async for message in call:
            messages.append(message)
    except aio.AioRpcError as error:
        return messages, error
    return messages, None


async def is_healthy(address: str, model: str, runtime: str = "sglang") -> bool:
    """The gateway's engine HealthCheck for a model (answered from its own state)."""
    async with channel(address) as ch:
        reply = await stub_for(ch, runtime).HealthCheck(
            pb_for(runtime).HealthCheckRequest(), metadata=model_md(model), timeout=2
        )
    return bool(reply.healthy)


async def wait_health(
    address: str, model: str, runtime: str = "sglang", healthy: bool = True
) -> None:
    """Poll (bounded) until the gateway says the model is (or is not) servable."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await is_healthy(address, model, runtime) is healthy:
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"model {model!r} did not become healthy={healthy} within {WAIT_S}s")


async def running_on_sim(address: str, runtime: str = "sglang") -> int:
    """Requests a simulated worker reports running (GetLoads straight to the worker)."""
    async with channel(address) as ch:
        loads = await stub_for(ch, runtime).GetLoads(pb_for(runtime).GetLoadsRequest(), timeout=2)
    return sum(load.num_running_reqs for load in loads.loads)


async def wait_running(
    address: str, count: int, runtime: str = "sglang", within_s: float = WAIT_S
) -> int:
    """Poll (bounded) until the worker runs `count` requests; returns the last count seen."""
    deadline = time.monotonic() + within_s
    running = await running_on_sim(address, runtime)
    while running != count and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        running = await running_on_sim(address, runtime)
    return running


async def wait_idle(address: str, runtime: str = "sglang", within_s: float = WAIT_S) -> int:
    """Poll (bounded) until the worker runs nothing; returns the last count seen."""
    return await wait_running(address, 0, runtime, within_s)


def free_port() -> int:
    """A port nothing listens on now (bound, then released): for a process to listen on,
    or a worker address that refuses connections."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def closed_port() -> socket.socket:
    """A bound, never-listening socket: connecting to its port is refused, and no other
    process can take the port while the caller keeps the socket."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def dead_worker_url(sock: socket.socket, **query: str) -> str:
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return f"grpc://127.0.0.1:{sock.getsockname()[1]}" + (f"?{params}" if params else "")


# --------------------------------------------------------------------------- health


def status_name(status: int) -> str:
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(status))


async def health_check(address: str, name: str) -> int:
    async with channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=name), timeout=2
        )
    return int(reply.status)


async def wait_health_status(
    address: str, name: str, status: int, within_s: float = WAIT_S
) -> float:
    """Poll Check (bounded) until `name` has `status`; returns the monotonic time seen."""
    deadline = time.monotonic() + within_s
    while True:
        if await health_check(address, name) == status:
            return time.monotonic()
        assert time.monotonic() < deadline, f"{name!r} not {status_name(status)} in {within_s}s"
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- admin


def admin_address(gw: Child) -> str:
    return f"127.0.0.1:{gw.port_of('admin')}"


async def list_workers(address: str, metadata: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """ListWorkers on the admin port: the workers by id."""
    async with aio.insecure_channel(address) as ch:
        reply = await admin_pb2_grpc.AdminServiceStub(ch).ListWorkers(
            admin_pb.ListWorkersRequest(), metadata=tuple(metadata) or None, timeout=2
        )
    return {w.id: w for w in reply.workers}
