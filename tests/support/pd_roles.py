"""The simulated worker's PD and EPD roles, for the simulator's role tests (tests/sim/test_pd.py,
tests/sim/test_roles.py): one hosted worker per role shared by a module's tests (`sims`, a
fixture), the requests with their rendezvous parameters, Generate over real protos, and
the decode's loads while its requests wait for their rooms."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from tests.support.launch import HostedSim, SimHost
from tests.support.waits import WAIT_S

PROMPT = [5, 7, 11, 13]
HOST = "127.0.0.1"
TIMEOUT_MS = 500  # the bounded waits the failing tests wait out: short, so they stay fast
# The bounded waits the other tests must not run into, however busy the machine: a
# worker that skipped its wait answers long before this, and no clock need be read.
PATIENT_MS = 120_000

# One worker per role (hosted, tests/sim/conftest.py), shared by the module's tests.
Sims = dict[str, HostedSim]
ROLES: dict[str, tuple[str, ...]] = {
    "sgl_prefill": ("--role", "prefill", "--name", "sgl-p"),
    "sgl_decode": ("--role", "decode", "--bootstrap-timeout-ms", str(PATIENT_MS)),
    "sgl_decode_hasty": ("--role", "decode", "--bootstrap-timeout-ms", str(TIMEOUT_MS)),
    "sgl_regular": ("--name", "sgl-r"),
    "vllm_prefill": ("--runtime", "vllm", "--role", "prefill", "--name", "vllm-p"),
    "vllm_omit": ("--runtime", "vllm", "--role", "prefill", "--omit-kv-params"),
    "vllm_decode": ("--runtime", "vllm", "--role", "decode", "--kv-timeout-ms", "1000"),
    "vllm_regular": (
        "--runtime",
        "vllm",
    ),
    "epd_prefill": ("--role", "prefill", "--embedding-timeout-ms", str(PATIENT_MS)),
    "epd_prefill_hasty": ("--role", "prefill", "--embedding-timeout-ms", str(TIMEOUT_MS)),
    "encoder_a": ("--role", "encode", "--ttft-ms", "20", "--name", "enc-a"),
    "encoder_b": ("--role", "encode", "--runtime", "vllm", "--name", "enc-b"),
}


@pytest.fixture(scope="module")
def sims(sim_host: SimHost) -> Iterator[Sims]:
    started: Sims = {}
    try:
        for name, args in ROLES.items():
            started[name] = sim_host.start(*args)
        yield started
    finally:
        for worker in started.values():
            worker.stop()


def sgl_request(
    request_id: str,
    *,
    room: int | None = None,
    host: str = HOST,
    port: int = 0,
    max_new_tokens: int = 5,
    stream: bool = True,
    n: int = 0,
    return_logprob: bool = False,
    image_urls: tuple[str, ...] = (),
) -> Any:
    request = sgl_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=sgl_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=sgl_pb2.SamplingParams(max_new_tokens=max_new_tokens, n=n),
        stream=stream,
        return_logprob=return_logprob,
    )
    if room is not None:
        request.disaggregated_params.CopyFrom(
            sgl_pb2.DisaggregatedParams(
                bootstrap_host=host, bootstrap_port=port, bootstrap_room=room
            )
        )
    if image_urls:
        request.mm_inputs.image_urls.extend(image_urls)
    return request


async def generate(sim: HostedSim, request: Any, runtime: str = "sglang") -> list[Any]:
    async with grpc.aio.insecure_channel(sim.address) as ch:
        stub: Any = (
            sgl_grpc.SglangSchedulerStub(ch)
            if runtime == "sglang"
            else vllm_grpc.VllmEngineStub(ch)
        )
        return [message async for message in stub.Generate(request, timeout=WAIT_S)]


async def generate_error(
    sim: HostedSim, request: Any, runtime: str = "sglang"
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(sim, request, runtime)
    return info.value


async def waiting_for_rooms(stub: sgl_grpc.SglangSchedulerStub, count: int) -> Any:
    """The decode's loads once `count` of its requests wait for their rooms (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest(), timeout=WAIT_S)
        if loads.loads[0].disaggregation.decode_transfer_queue_reqs == count:
            return loads
        assert time.monotonic() < deadline, f"not {count} waiting for their rooms: {loads}"
        await asyncio.sleep(0.01)
