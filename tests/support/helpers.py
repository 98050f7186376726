"""Client helpers for end-to-end tests: generated stubs over grpc.aio, rich-status decoding."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.rpc import error_details_pb2, status_pb2
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim.launch import Child, start, start_sim
from tests.conftest import SERVE_ARGS, START_S, HostedSim, SimHost, stop_child
from tests.support.waits import WAIT_S

__all__ = ["sgl", "sgl_grpc", "vllm", "vllm_grpc"]

MAX = 256 * 1024 * 1024


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


# A simulated SGLang worker ends an aborted stream with a Complete `abort` (as vLLM does),
# for a test that waits on that end: a real SGLang worker's stream gets nothing more.
ABORT_COMPLETES = ("x-sim-abort-completes", "1")


def trailers(error: aio.AioRpcError) -> dict[str, Any]:
    return {k: v for k, v in (error.trailing_metadata() or ())}


def rich_status(error: aio.AioRpcError) -> tuple[status_pb2.Status, dict[str, Any]]:
    """Decode grpc-status-details-bin: the Status and its details by type name."""
    raw = trailers(error)["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    details: dict[str, Any] = {}
    for packed in status.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.RetryInfo,
            error_details_pb2.BadRequest,
        ):
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                details[kind.DESCRIPTOR.name] = message
    return status, details


def request_events(log_path: Path, rpc: str | None = None) -> Sequence[dict[str, Any]]:
    """The gateway's per-request log events (JSON lines)."""
    events = []
    for line in log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "request" and (rpc is None or event.get("rpc") == rpc):
            events.append(event)
    return events


# --------------------------------------------------------------------------- processes

SGL_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
VLLM_SERVICE = "vllm.grpc.engine.VllmEngine"
POLL_S = 0.05


def start_many(launch: Callable[..., Child], *argsets: Sequence[str]) -> list[Child]:
    """Start several processes at once (each start waits for READY: in parallel it is faster)."""
    with ThreadPoolExecutor(max_workers=len(argsets)) as pool:
        return list(pool.map(lambda args: launch(*args), argsets))


def write_config(directory: Path, data: dict[str, Any]) -> str:
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def wait_for_events(
    log_path: Path, count: int, rpc: str | None = None, request_id: str | None = None
) -> Sequence[dict[str, Any]]:
    """The request events once at least `count` are logged (the log line follows the reply).

    `request_id` picks one request's events out of a log that several tests share.
    """

    def matching() -> list[dict[str, Any]]:
        events = request_events(log_path, rpc)
        return [e for e in events if request_id is None or e.get("request_id") == request_id]

    deadline = time.monotonic() + WAIT_S
    events = matching()
    while len(events) < count and time.monotonic() < deadline:
        time.sleep(POLL_S)
        events = matching()
    assert len(events) >= count, f"expected {count} request events, got {events}"
    return events


# --------------------------------------------------------------------------- clients


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


def assert_verdict(
    error: aio.AioRpcError,
    code: grpc.StatusCode,
    reason: str,
    message: str,
    metadata: dict[str, str],
    *,
    retry_s: int | None = None,
    pushback_ms: int | None = None,
    retry_ms_exact: bool = False,
) -> None:
    """A placement verdict: code, message, ErrorInfo, RetryInfo and the plain trailers
    (`retry_ms_exact`: RetryInfo is `pushback_ms` to the millisecond, `retry-after` its
    seconds rounded up)."""
    assert error.code() is code
    assert error.details() == message
    status, details = rich_status(error)
    assert status.code == code.value[0]
    assert status.message == message
    info = details["ErrorInfo"]
    assert info.reason == reason
    assert info.domain == "model-gateway.grpc"
    assert dict(info.metadata) == metadata
    plain = trailers(error)
    assert plain["x-http-status"] == metadata["httpStatus"]
    if retry_s is None:
        assert "RetryInfo" not in details
        assert "retry-after" not in plain
    else:
        delay_ms = details["RetryInfo"].retry_delay.ToMilliseconds()
        assert delay_ms == (pushback_ms if retry_ms_exact else retry_s * 1000)
        assert plain["retry-after"] == str(retry_s)
    if pushback_ms is None:
        assert "grpc-retry-pushback-ms" not in plain
    else:
        assert plain["grpc-retry-pushback-ms"] == str(pushback_ms)


def closed_port() -> socket.socket:
    """A bound, never-listening socket: connecting to its port is refused, and no other
    process can take the port while the caller keeps the socket."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def dead_worker_url(sock: socket.socket, **query: str) -> str:
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return f"grpc://127.0.0.1:{sock.getsockname()[1]}" + (f"?{params}" if params else "")


class SharedProcesses:
    """Processes a module-scoped fixture shares between tests (starting Python processes
    is most of an end-to-end test's cost). Started like the `sim`/`gateway` fixtures do:
    simulated workers hosted by `host` if given (tests/conftest.py), else processes."""

    def __init__(self, log_dir: Path, host: SimHost | None = None) -> None:
        self.children: list[Any] = []
        self._log_dir = log_dir
        self._host = host

    def sim(self, *args: str) -> Any:
        child: Child | HostedSim
        if self._host is not None:
            child = self._host.start(*args)
        else:
            child = start_sim(*args, timeout=START_S)
        self.children.append(child)
        return child

    def sims(self, *argsets: Sequence[str]) -> list[Child]:
        return start_many(self.sim, *argsets)

    def gateway(self, *args: str) -> Child:
        log_path = self._log_dir / f"gateway-{len(self.children)}.log"
        with open(log_path, "w") as log_file:
            child = start([*SERVE_ARGS, *args], stderr=log_file.fileno(), timeout=START_S)
        child.log_path = log_path
        self.children.append(child)
        return child

    def stop(self) -> None:
        for child in reversed(self.children):
            if isinstance(child, HostedSim):
                child.stop()
            else:
                stop_child(child)
