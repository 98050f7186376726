"""EPD and the roles of the simulated worker: two encoders feeding one prefill (and an
encoder's failures failing it), what each role's server info reports, an abort while a
decode waits for its room, and, in process, the pieces the roles are built of (the role
flags, the rendezvous line, the mailbox)."""

from __future__ import annotations

import argparse
import asyncio
import time
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
from gateway_sim.client import free_port
from gateway_sim.lines import Line, ProtocolError
from gateway_sim.mailbox import Mailbox
from gateway_sim.model import output_tokens
from tests.support import pd_roles
from tests.support.launch import HostedSim
from tests.support.pd_roles import (
    HOST,
    PROMPT,
    Sims,
    generate,
    generate_error,
    sgl_request,
    waiting_for_rooms,
)
from tests.support.waits import WAIT_S

sims = pd_roles.sims  # the fixture (tests/support/pd_roles.py)


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
