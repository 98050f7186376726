"""PD roles of the simulated worker, SGLang and vLLM: real workers rendezvousing over real
TCP.

The point of these roles is that wrong rendezvous parameters fail the way production
would, so every happy path here has a wrong-parameter twin that must fail, in time.
(EPD, the server info of every role and the pieces the roles are built of:
tests/sim/test_roles.py.)
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

from gateway_sim.client import free_port
from gateway_sim.model import input_logprobs_for, output_tokens
from tests.support import pd_roles
from tests.support.pd_roles import (
    HOST,
    PROMPT,
    Sims,
    generate,
    generate_error,
    sgl_request,
    waiting_for_rooms,
)

sims = pd_roles.sims  # the fixture (tests/support/pd_roles.py)


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
