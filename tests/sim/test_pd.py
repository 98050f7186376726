"""PD and EPD roles of the simulated worker: real processes rendezvousing over real TCP.

The point of these roles is that wrong rendezvous parameters fail the way production
would, so every happy path here has a wrong-parameter twin that must fail, in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_encoder_pb2 as enc_pb2
from smg_grpc_proto.generated import sglang_encoder_pb2_grpc as enc_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim import SimConfig, add_sim_arguments
from gateway_sim.lines import Line, ProtocolError
from gateway_sim.mailbox import Mailbox
from gateway_sim.model import input_logprobs_for, output_tokens
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


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


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


def vllm_request(
    request_id: str,
    params: dict[str, Any] | str | None,
    *,
    max_tokens: int = 5,
    stream: bool = True,
) -> Any:
    request = vllm_pb2.GenerateRequest(
        request_id=request_id,
        tokenized=vllm_pb2.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm_pb2.SamplingParams(max_tokens=max_tokens),
        stream=stream,
    )
    if params is not None:
        request.kv_transfer_params_json = params if isinstance(params, str) else json.dumps(params)
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


def tokens(messages: list[Any]) -> list[int]:
    return [t for m in messages if m.WhichOneof("response") == "chunk" for t in m.chunk.token_ids]


async def sgl_pd(
    sims: Sims, request_id: str, room: int, **kwargs: Any
) -> tuple[list[Any], list[Any]]:
    """Both legs at once, as the router sends them (the decode starts first here, so it
    really waits on the room)."""
    port = int(sims["sgl_prefill"].extra["bootstrap"])
    decode = asyncio.create_task(
        generate(sims["sgl_decode"], sgl_request(request_id, room=room, port=port, **kwargs))
    )
    await asyncio.sleep(0.05)
    prefill = await generate(
        sims["sgl_prefill"], sgl_request(request_id, room=room, port=port, **kwargs)
    )
    return prefill, await decode


async def waiting_for_rooms(stub: sgl_grpc.SglangSchedulerStub, count: int) -> Any:
    """The decode's loads once `count` of its requests wait for their rooms (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest(), timeout=WAIT_S)
        if loads.loads[0].disaggregation.decode_transfer_queue_reqs == count:
            return loads
        assert time.monotonic() < deadline, f"not {count} waiting for their rooms: {loads}"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- SGLang PD


async def test_sglang_pd_decode_streams_what_a_regular_worker_does(
    sims: Sims,
) -> None:
    regular = await generate(sims["sgl_regular"], sgl_request("pd-1"))
    prefill, decode = await sgl_pd(sims, "pd-1", room=1001)

    # as SGLang 0.5.23's prefill answers a streamed request: its one token, then Complete
    assert [m.WhichOneof("response") for m in prefill] == ["chunk", "complete"]
    complete = prefill[-1].complete
    assert list(complete.output_ids) == output_tokens(PROMPT, 1)
    assert (complete.finish_reason, complete.prompt_tokens) == ("length", len(PROMPT))
    assert not complete.HasField("input_logprobs")

    assert tokens(decode) == tokens(regular) == output_tokens(PROMPT, 5)
    assert tokens(decode)[0] == complete.output_ids[0]
    assert list(decode[-1].complete.output_ids) == list(regular[-1].complete.output_ids)
    assert decode[-1].complete.finish_reason == "length"


@pytest.mark.serial  # 0.4-2 s for a 0.5 s timeout
async def test_sglang_wrong_room_fails_the_decode_in_time(sims: Sims, strict: bool) -> None:
    """The decode gives up after its bootstrap timeout (its message says so), not before
    (within 2 s in the timing tier)."""
    port = int(sims["sgl_prefill"].extra["bootstrap"])
    started = time.monotonic()
    decode = asyncio.create_task(
        generate_error(sims["sgl_decode_hasty"], sgl_request("pd-2", room=2002, port=port))
    )
    prefill = await generate(sims["sgl_prefill"], sgl_request("pd-2", room=2003, port=port))
    error = await decode
    elapsed = time.monotonic() - started
    assert prefill[-1].complete.output_ids  # the prefill does its part; no taker for its room
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == (
        f"KV transfer failed: bootstrap room 2002 not received from {HOST}:{port} within 0.5 s"
    )
    assert elapsed > 0.4
    if strict:
        assert elapsed < 2.0


async def test_sglang_wrong_bootstrap_address(sims: Sims) -> None:
    prefill = sims["sgl_prefill"]
    port = int(prefill.extra["bootstrap"])
    wrong_host = sgl_request("pd-3", room=3003, host="127.0.0.2", port=port)
    wrong_port = sgl_request("pd-3", room=3003, port=sims["sgl_prefill"].port)
    for request in (wrong_host, wrong_port):
        error = await generate_error(prefill, request)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"is not this prefill's ({HOST}:{port})" in (error.details() or "")
    assert "bootstrap address 127.0.0.2:" in (
        (await generate_error(prefill, wrong_host)).details() or ""
    )

    # The decode given the same wrong address cannot reach any bootstrap server: refused,
    # with no need to wait for its (two-minute) timeout.
    error = await generate_error(sims["sgl_decode"], wrong_host)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == (
        f"KV transfer failed: bootstrap server 127.0.0.2:{port} refused the connection "
        "(bootstrap room 3003)"
    )


async def test_sglang_decode_without_prefill(sims: Sims) -> None:
    port = free_port()
    error = await generate_error(sims["sgl_decode_hasty"], sgl_request("pd-4", room=4, port=port))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert f"bootstrap server {HOST}:{port} refused the connection" in (error.details() or "")
    # A regular worker's port is no bootstrap server either: it answers no room.
    error = await generate_error(
        sims["sgl_decode_hasty"], sgl_request("pd-4", room=4, port=sims["sgl_regular"].port)
    )
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "KV transfer failed: bootstrap room 4" in (error.details() or "")


async def test_sglang_pd_bad_requests(sims: Sims) -> None:
    port = int(sims["sgl_prefill"].extra["bootstrap"])
    for role, message in (("sgl_prefill", "prefill"), ("sgl_decode", "decode")):
        error = await generate_error(sims[role], sgl_request("pd-5"))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == f"{message} worker needs disaggregated_params"
        error = await generate_error(sims[role], sgl_request("pd-5", room=5, port=port, n=2))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "n>1 is not supported in disaggregated mode"


async def test_sglang_input_logprobs_stay_with_the_prefill(sims: Sims) -> None:
    expected = input_logprobs_for(PROMPT)
    assert expected[0] is None and len(expected) == len(PROMPT)

    def values(logprobs: Any) -> list[float | None]:
        return [e.value if e.HasField("value") else None for e in logprobs.token_logprobs]

    prefill, decode = await sgl_pd(sims, "pd-6", room=6006, return_logprob=True)
    first, complete = prefill[0].chunk, prefill[-1].complete  # SGLang's prefill: in both
    for logprobs in (first.input_logprobs, complete.input_logprobs):
        assert values(logprobs) == expected
        assert list(logprobs.token_ids) == PROMPT
    # As with SGLang's decode server: the gateway has to bring them to the client.
    assert not any(m.chunk.HasField("input_logprobs") for m in decode[:-1])
    assert not decode[-1].complete.HasField("input_logprobs")

    _, whole = await sgl_pd(sims, "pd-7", room=6007, return_logprob=True, stream=False)
    assert len(whole) == 1
    assert not whole[0].complete.HasField("input_logprobs")
    assert list(whole[0].complete.output_ids) == output_tokens(PROMPT, 5)


async def test_sglang_rendezvous_stats(sims: Sims) -> None:
    port = int(sims["sgl_prefill"].extra["bootstrap"])
    decode = asyncio.create_task(
        generate(sims["sgl_decode"], sgl_request("pd-8", room=8008, port=port))
    )
    async with grpc.aio.insecure_channel(sims["sgl_decode"].address) as ch:
        loads = await waiting_for_rooms(sgl_grpc.SglangSchedulerStub(ch), 1)
        metrics = loads.loads[0].disaggregation
        assert (metrics.mode, metrics.decode_transfer_queue_reqs) == ("decode", 1)
        assert loads.loads[0].num_running_reqs == 1
    await generate(sims["sgl_prefill"], sgl_request("pd-8", room=8008, port=port))
    assert tokens(await decode) == output_tokens(PROMPT, 5)

    # A room no decode takes stays in the prefill's inflight queue (until it expires).
    await generate(sims["sgl_prefill"], sgl_request("pd-9", room=8009, port=port))
    async with grpc.aio.insecure_channel(sims["sgl_prefill"].address) as ch:
        loads = await sgl_grpc.SglangSchedulerStub(ch).GetLoads(sgl_pb2.GetLoadsRequest())
    metrics = loads.loads[0].disaggregation
    assert metrics.mode == "prefill" and metrics.prefill_inflight_queue_reqs >= 1


# ----------------------------------------------------------------------------- vLLM PD


async def test_vllm_pd_hands_over_through_params(sims: Sims) -> None:
    prefill_sim = sims["vllm_prefill"]
    kv_port = int(prefill_sim.extra["kv"])
    to_prefill = {"do_remote_decode": True, "do_remote_prefill": False}
    prefill = await generate(
        prefill_sim, vllm_request("v-1", to_prefill, max_tokens=1, stream=False), "vllm"
    )
    assert len(prefill) == 1
    complete = prefill[0].complete
    assert list(complete.output_ids) == output_tokens(PROMPT, 1)
    assert complete.finish_reason == "length"
    params = json.loads(complete.kv_transfer_params_json)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == (HOST, kv_port)
    assert params["remote_request_id"] == "v-1" and params["remote_engine_id"] == "vllm-p"
    assert params["remote_block_ids"] and params["remote_num_tokens"] == len(PROMPT)
    assert (complete.kv_transfer_params.remote_host, complete.kv_transfer_params.remote_port) == (
        HOST,
        kv_port,
    )

    regular = await generate(sims["vllm_regular"], vllm_request("v-1", None), "vllm")
    decode = await generate(sims["vllm_decode"], vllm_request("v-1", params), "vllm")
    assert tokens(decode) == tokens(regular) == output_tokens(PROMPT, 5)
    assert list(decode[-1].complete.output_ids) == list(regular[-1].complete.output_ids)

    # The KV moved once: the same params again find nothing.
    error = await generate_error(sims["vllm_decode"], vllm_request("v-1", params), "vllm")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == (
        f"KV transfer failed: request v-1 from {HOST}:{kv_port}: "
        "no such request on that KV side channel"
    )


async def test_vllm_decode_with_bogus_params(sims: Sims) -> None:
    kv_port = int(sims["vllm_prefill"].extra["kv"])
    decode = sims["vllm_decode"]
    good: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_host": HOST,
        "remote_port": kv_port,
        "remote_request_id": "never-prefilled",
    }
    closed = free_port()
    cases: dict[str, dict[str, Any]] = {
        "no such request": good,
        "connection refused": {**good, "remote_port": closed},
        "need remote_host, remote_port and remote_request_id": {"do_remote_prefill": True},
    }
    for fragment, params in cases.items():
        error = await generate_error(decode, vllm_request("v-2", params), "vllm")
        assert error.code() == grpc.StatusCode.INTERNAL, fragment
        assert "KV transfer failed" in (error.details() or "")
        assert fragment in (error.details() or "")

    wrong: list[dict[str, Any] | str | None] = [None, "not json", {"do_remote_decode": True}]
    for bad in wrong:
        error = await generate_error(decode, vllm_request("v-3", bad), "vllm")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "decode worker expects kv_transfer_params do_remote_prefill" in (
            error.details() or ""
        )
    error = await generate_error(sims["vllm_prefill"], vllm_request("v-4", None), "vllm")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefill worker expects kv_transfer_params do_remote_decode" in (error.details() or "")


async def test_vllm_omit_kv_params(sims: Sims) -> None:
    messages = await generate(
        sims["vllm_omit"], vllm_request("v-5", {"do_remote_decode": True}, stream=False), "vllm"
    )
    assert len(messages) == 1
    complete = messages[0].complete
    assert list(complete.output_ids) == output_tokens(PROMPT, 1)
    assert not complete.HasField("kv_transfer_params_json")


# --------------------------------------------------------------------------------- EPD


async def encode(
    encoder: HostedSim, req_id: str, items: list[str], part_idx: int, num_parts: int, port: int
) -> tuple[Any, dict[str, Any]]:
    async with grpc.aio.insecure_channel(encoder.address) as ch:
        call = enc_grpc.SglangEncoderStub(ch).Encode(
            enc_pb2.EncodeRequest(
                mm_items=items,
                req_id=req_id,
                num_parts=num_parts,
                part_idx=part_idx,
                prefill_host=HOST,
                embedding_port=[port],
            ),
            timeout=WAIT_S,
        )
        response = await call
        return response, dict(await call.initial_metadata())


def epd_request(prefill: HostedSim, request_id: str, urls: tuple[str, ...]) -> Any:
    port = int(prefill.extra["bootstrap"])
    return sgl_request(request_id, room=77, port=port, image_urls=urls)


@pytest.mark.serial  # answers within 0.3 s and 1 s
async def test_epd_two_encoders_feed_one_prefill(sims: Sims, strict: bool) -> None:
    """Two encoders' parts make one prefill's embeddings; with one part of two, a prefill
    gives up after its embedding timeout (its message says so; within 1 s in the timing
    tier); without multimodal items it does not wait at all (not for its two-minute
    timeout; within 0.3 s in the timing tier)."""
    prefill = sims["epd_prefill"]
    port = int(prefill.extra["embedding"])
    urls = ("http://img/a.png", "http://img/b.png", "http://img/c.png")
    generating = asyncio.create_task(generate(prefill, epd_request(prefill, "e-1", urls)))
    await asyncio.sleep(0.05)  # the prefill is waiting for its parts now
    (a, a_headers), (b, b_headers) = await asyncio.gather(
        encode(sims["encoder_a"], "e-1", list(urls[:2]), 0, 2, port),
        encode(sims["encoder_b"], "e-1", list(urls[2:]), 1, 2, port),
    )
    messages = await generating
    assert list(messages[-1].complete.output_ids) == output_tokens(PROMPT, 1)
    assert (a.embedding_len, a.embedding_dim, a.embedding_size) == (32, 64, 32 * 64 * 4)
    assert b.embedding_len == 16
    assert a_headers["x-sim-worker"] == "enc-a" and b_headers["x-sim-worker"] == "enc-b"
    first_a = int(a_headers["x-sim-encoded-items"])

    # Only one of two parts: the prefill gives up after its embedding timeout.
    hasty = sims["epd_prefill_hasty"]
    hasty_port = int(hasty.extra["embedding"])
    failing = asyncio.create_task(generate_error(hasty, epd_request(hasty, "e-2", urls[:2])))
    _, again = await encode(sims["encoder_a"], "e-2", list(urls[:1]), 0, 2, hasty_port)
    started = time.monotonic()
    error = await failing
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "embeddings for request e-2: got 1 of 2 parts within 0.5 s"
    if strict:
        assert time.monotonic() - started < 1.0
    assert int(again["x-sim-encoded-items"]) == first_a + 1

    # A request without multimodal items does not wait at all.
    started = time.monotonic()
    assert (await generate(prefill, epd_request(prefill, "e-3", ())))[-1].complete.output_ids
    if strict:
        assert time.monotonic() - started < 0.3


async def test_encoder_failures(sims: Sims) -> None:
    encoder = sims["encoder_b"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await encode(encoder, "e-4", ["http://img/x.png"], 0, 1, free_port())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "connection refused" in (refused.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await encode(encoder, "e-5", [], 0, 1, free_port())
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as bad_part:
        await encode(encoder, "e-6", ["x"], 2, 2, free_port())
    assert bad_part.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------------- server info


async def test_server_info_reports_the_role(sims: Sims) -> None:
    async def sgl_args(sim: HostedSim) -> dict[str, Any]:
        async with grpc.aio.insecure_channel(sim.address) as ch:
            info = await sgl_grpc.SglangSchedulerStub(ch).GetServerInfo(
                sgl_pb2.GetServerInfoRequest()
            )
        return dict(info.server_args.items())

    async def vllm_info(sim: HostedSim) -> Any:
        async with grpc.aio.insecure_channel(sim.address) as ch:
            return await vllm_grpc.VllmEngineStub(ch).GetServerInfo(vllm_pb2.GetServerInfoRequest())

    prefill = await sgl_args(sims["sgl_prefill"])
    assert prefill["disaggregation_mode"] == "prefill"
    assert prefill["disaggregation_bootstrap_port"] == int(sims["sgl_prefill"].extra["bootstrap"])
    decode = await sgl_args(sims["sgl_decode"])
    # a decode reports SGLang's default, as every worker not given a port does
    assert (decode["disaggregation_mode"], decode["disaggregation_bootstrap_port"]) == (
        "decode",
        8998,
    )
    regular = await sgl_args(sims["sgl_regular"])
    assert (regular["disaggregation_mode"], regular["disaggregation_bootstrap_port"]) == (
        "null",
        8998,
    )

    producer = await vllm_info(sims["vllm_prefill"])
    assert (producer.kv_role, producer.kv_connector, producer.kv_engine_id) == (
        "kv_producer",
        "NixlConnector",
        "vllm-p",
    )
    consumer = await vllm_info(sims["vllm_decode"])
    assert (consumer.kv_role, consumer.kv_connector) == ("kv_consumer", "NixlConnector")
    plain = await vllm_info(sims["vllm_regular"])
    assert (plain.kv_role, plain.kv_connector) == ("", "")

    async with grpc.aio.insecure_channel(sims["encoder_a"].address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "sglang.grpc.encoder.SglangEncoder"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert set(sims["sgl_prefill"].extra) == {"bootstrap", "embedding"}
    assert set(sims["vllm_prefill"].extra) == {"kv"}
    assert sims["sgl_decode"].extra == {} and sims["encoder_a"].extra == {}


@pytest.mark.serial  # an answer within 0.3 s
async def test_abort_while_waiting_for_the_room(sims: Sims, strict: bool) -> None:
    """An Abort ends a decode's wait for its room (its two-minute bootstrap timeout
    does not: the stream ends `abort`, within 0.3 s in the timing tier)."""
    port = int(sims["sgl_prefill"].extra["bootstrap"])
    decode = sims["sgl_decode"]
    async with grpc.aio.insecure_channel(decode.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_request("pd-ab", room=9999, port=port), timeout=WAIT_S)
        await waiting_for_rooms(stub, 1)
        started = time.monotonic()
        assert (await stub.Abort(sgl_pb2.AbortRequest(request_id="pd-ab"))).success
        messages = [message async for message in call]
        if strict:
            assert time.monotonic() - started < 0.3
        loads = await stub.GetLoads(sgl_pb2.GetLoadsRequest())
    # Streamed: the final output with no new token, then its Complete.
    assert [m.WhichOneof("response") for m in messages] == ["chunk", "complete"]
    assert list(messages[0].chunk.token_ids) == []
    assert messages[1].complete.finish_reason == "abort"
    assert list(messages[1].complete.output_ids) == []
    assert loads.loads[0].num_running_reqs == 0
    assert loads.loads[0].disaggregation.decode_transfer_queue_reqs == 0


# ------------------------------------------------------------------ pieces, in process


def test_role_flags() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    config = SimConfig.from_args(parser.parse_args([]))
    assert (config.role, config.bootstrap_port, config.kv_port, config.embedding_port) == (
        "regular",
        0,
        0,
        0,
    )
    assert config.bootstrap_timeout_s == config.kv_timeout_s == config.embedding_timeout_s == 3.0
    config = SimConfig.from_args(
        parser.parse_args(["--role=encode", "--bootstrap-timeout-ms=250", "--omit-kv-params"])
    )
    assert config.role == "encode" and config.bootstrap_timeout_s == 0.25
    assert config.omit_kv_params and config.worker_name(7) == "encoder@127.0.0.1:7"
    for bad in (["--role=router"], ["--kv-port=70000"], ["--bootstrap-timeout-ms=-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_line_round_trip() -> None:
    line = Line("WAIT", "req id/with spaces\n", {"wait_ms": 5})
    raw = line.encode()
    assert raw.count(b"\n") == 1 and raw.startswith(b"WAIT req%20id%2Fwith%20spaces%0A ")
    assert Line.decode(raw) == line
    assert Line.decode(b"OK 7\n") == Line("OK", "7", {})
    for garbage in (b"\x16\x03\x01\n", b"wait 1\n", b"WAIT\n", b"WAIT 1 [1]\n", b"WAIT 1 {\n"):
        with pytest.raises(ProtocolError):
            Line.decode(garbage)


async def test_mailbox_waits_takes_and_expires() -> None:
    box: Mailbox[int] = Mailbox(ttl_s=0.2)
    waiter = asyncio.create_task(box.wait("k", 1.0, lambda value: value >= 2))
    await asyncio.sleep(0)
    assert box.waiting == 1
    box.put("k", 1)
    await asyncio.sleep(0)
    assert not waiter.done()  # there, but not ready yet
    box.put("k", 2)
    assert await waiter == 2 and box.waiting == 0
    assert box.take("k") == 2 and box.take("k") is None
    assert await box.wait("missing", 0.05) is None
    box.put("old", 1)
    await asyncio.sleep(0.25)
    assert box.peek("old") is None and len(box) == 0
