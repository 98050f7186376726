"""Serving processes of one gateway, in process: an abort on one reaches the stream held
by the other (same principal only), each process's metrics through the peer service, and
the bootstrap rooms each process takes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway.app.server import Gateway
from gateway.peer.v1 import peer_pb2 as peer
from gateway.peer.v1 import peer_pb2_grpc
from gateway.scale.member import Member
from gateway_sim.client import collect, model_md, sgl_generate, vllm_generate
from tests.support.helpers import ABORT_COMPLETES
from tests.support.inproc import client, gateway, idle, sim

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789"}


def bearer(who: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {KEYS[who]}")


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Gateway, Gateway]]:
    """Process 0 and 1 of 2, with API keys, in front of one slow simulated worker."""
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{n}:{k}\n" for n, k in KEYS.items()))
    members = [Member(i, 2, str(tmp_path)) for i in range(2)]
    async with sim("--model", "m", "--token-ms", "20") as worker:
        url = worker.url(model="m", runtime="sglang")
        extra: dict[str, Any] = {"auth.api_keys_file": str(keys)}
        async with (
            gateway(url, member=members[0], **extra) as first,
            gateway(url, member=members[1], **extra) as second,
        ):
            yield first, second


async def test_an_abort_on_one_process_reaches_the_stream_the_other_holds(
    pair: tuple[Gateway, Gateway],
) -> None:
    holder, other = pair
    async with client(holder) as near, client(other) as far:
        stream = sgl_grpc.SglangSchedulerStub(near).Generate(
            sgl_generate("long", 200), metadata=model_md("m", bearer("alice"), ABORT_COMPLETES)
        )
        assert (await stream.__aiter__().__anext__()).HasField("chunk")
        assert (len(holder.parts.inflight), len(other.parts.inflight)) == (1, 0)

        async def abort(who: str) -> sgl.AbortResponse:
            return await sgl_grpc.SglangSchedulerStub(far).Abort(
                sgl.AbortRequest(request_id="long"), metadata=model_md("m", bearer(who))
            )

        foreign = await abort("bob")  # someone else's id answers like an unknown one
        assert (foreign.success, foreign.message) == (False, "request 'long' is not in flight here")
        mine = await abort("alice")
        assert mine.success is True
        rest, error = await collect(stream)
        assert error is None and rest[-1].complete.finish_reason == "abort"
        assert len(rest) < 199
    await idle(holder)
    await idle(other)


async def test_each_process_shows_its_own_metrics_to_the_supervisor(
    pair: tuple[Gateway, Gateway],
) -> None:
    first = pair[0]
    async with client(first) as ch:
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("one", 2), metadata=model_md("m", bearer("alice"))
        )
        _, error = await collect(call)
        assert error is None
    texts = []
    for gw in pair:
        assert gw.member is not None
        async with aio.insecure_channel(gw.member.control_address()) as control:
            reply = await peer_pb2_grpc.PeerServiceStub(control).Metrics(peer.MetricsRequest())
            texts.append(reply.text)
    generate = 'gateway_requests_total{code="OK",model="m",rpc="Generate",'
    assert [generate in text for text in texts] == [True, False]


async def test_a_sibling_refuses_an_abort_for_a_service_it_does_not_serve(
    pair: tuple[Gateway, Gateway],
) -> None:
    member = pair[0].member
    assert member is not None
    async with aio.insecure_channel(member.control_address()) as control:
        with pytest.raises(aio.AioRpcError) as error:
            await peer_pb2_grpc.PeerServiceStub(control).AbortHeld(
                peer.AbortHeldRequest(service="nope.Engine", request=b"")
            )
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "no such engine service"


def test_each_process_takes_its_own_bootstrap_rooms(pair: tuple[Gateway, Gateway]) -> None:
    rooms = [[gw.parts.disagg.rooms.allocate() % 2 for _ in range(20)] for gw in pair]
    assert rooms == [[0] * 20, [1] * 20]


async def test_one_vllm_abort_reaches_requests_on_both_processes(tmp_path: Path) -> None:
    """A vLLM Abort may name several requests: the ones this process holds and the ones
    a sibling holds are all aborted, in one answer."""
    members = [Member(i, 2, str(tmp_path)) for i in range(2)]
    async with sim("--runtime", "vllm", "--model", "v", "--token-ms", "20") as worker:
        url = worker.url(model="v", runtime="vllm")
        async with (
            gateway(url, member=members[0]) as first,
            gateway(url, member=members[1]) as second,
            client(first) as near,
            client(second) as far,
        ):
            streams = []
            for ch, request_id in ((near, "here"), (far, "there")):
                call = vllm_grpc.VllmEngineStub(ch).Generate(
                    vllm_generate(request_id, 200), metadata=model_md("v")
                )
                await call.__aiter__().__anext__()
                streams.append(call)
            await vllm_grpc.VllmEngineStub(near).Abort(
                vllm.AbortRequest(request_ids=["here", "there", "nowhere"]),
                metadata=model_md("v"),
            )
            for call in streams:
                rest, error = await collect(call)
                assert error is None and len(rest) < 199
                assert rest[-1].complete.finish_reason == "abort"
            await idle(first)
            await idle(second)
