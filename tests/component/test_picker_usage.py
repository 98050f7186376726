"""A placed Generate's usage in picker mode (Envoy's side of the stream spoken directly,
the gateway in process): the picker marks the call for Envoy's Lua filter, reads the
messages that filter kept from the answer's trailers and removes that trailer before the
client could see it; with the response body streamed through the picker, it reads the
pieces as they pass. The record then carries what the worker reported, as the relay's
does, and nothing is held afterwards."""

from __future__ import annotations

import base64
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpc import aio

from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.observability.record import CallRecord
from gateway.picker import wire
from gateway.picker.answer_lua import TRAILER
from gateway.picker.service import Picker
from gateway.picker.v3 import external_processor_pb2 as ext_proc
from gateway.picker.v3 import processing_mode_pb2
from gateway_sim.client import model_md, sgl_generate
from tests.support.extproc import (
    body_part,
    header_map,
    headers_part,
    process,
    response_headers_part,
)
from tests.support.inproc import gateway, recorded, sim
from tests.support.waits import until

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
EMBED = "/sglang.grpc.scheduler.SglangScheduler/Embed"
SGLANG = engine_adapters()[Runtime.SGLANG]
Mode = processing_mode_pb2.ProcessingMode


def answer(kind: str, completion: int, cached: int = 0, index: int = 0) -> bytes:
    """One SGLang Generate answer, framed as a response body carries it."""
    response: Any = SGLANG.rpcs["Generate"].response_type()
    part = getattr(response, kind)
    part.completion_tokens, part.cached_tokens, part.index = completion, cached, index
    return wire.framed(bytes(response.SerializeToString()))


def trailers(*extra: tuple[str, str]) -> ext_proc.ProcessingRequest:
    pairs = [("grpc-status", "0"), *extra]
    return ext_proc.ProcessingRequest(
        response_trailers=ext_proc.HttpTrailers(trailers=header_map(pairs))
    )


def kept(frames: bytes) -> tuple[str, str]:
    """The trailer Envoy's Lua filter adds: the frames it kept, base64."""
    return (TRAILER, base64.b64encode(frames).decode())


@contextlib.asynccontextmanager
async def picker(**overrides: Any) -> AsyncIterator[tuple[Picker, aio.Channel, list[CallRecord]]]:
    """The picker of an in-process gateway with one SGLang worker (its configuration
    changed by `overrides`), on a port of its own (so the test holds it)."""
    async with (
        sim("--model", "m") as worker,
        gateway(worker.url(model="m", runtime="sglang"), **overrides) as gw,
    ):
        served = Picker(gw.parts.fronts, gw.config, "127.0.0.1:1")
        server = aio.server()
        server.add_generic_rpc_handlers((served.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                yield served, channel, recorded(gw)
        finally:
            await server.stop(None)


async def placed(channel: aio.Channel, request: Any, duplex: bool = False) -> tuple[Any, str]:
    """A Generate's stream up to its worker's response headers: the stream, and which of
    its answer's messages the picker asked Envoy to keep ("" for none)."""
    call = process(channel)()
    opening = headers_part(GENERATE, model_md("m"))
    if duplex:  # the response body passes the picker
        opening.protocol_config.request_body_mode = Mode.BUFFERED
        opening.protocol_config.response_body_mode = Mode.FULL_DUPLEX_STREAMED
    await call.write(opening)
    await call.read()
    await call.write(body_part(request.SerializeToString()))
    named = await call.read()
    await call.write(response_headers_part())
    await call.read()
    mark = named.dynamic_metadata.fields.get(wire.PICKER_NAMESPACE)
    return call, mark.struct_value.fields["answer"].string_value if mark else ""


async def ended(call: Any, *extra: tuple[str, str]) -> ext_proc.ProcessingResponse:
    """The answer's trailers sent: the picker's answer to them."""
    await call.write(trailers(*extra))
    reply = await call.read()
    assert await call.read() is aio.EOF
    assert isinstance(reply, ext_proc.ProcessingResponse)
    return reply


def ended_calls(records: list[CallRecord], count: int) -> bool:
    return len(records) == count


def nothing_held(served: Picker) -> bool:
    return served.answers.budget.held == 0


async def test_the_messages_envoy_kept_count_and_their_trailer_goes() -> None:
    async with picker() as (served, channel, records):
        call, mark = await placed(channel, sgl_generate(tokens=3))
        assert mark == "last"  # one choice's running totals: its last message says all
        reply = await ended(call, kept(answer("complete", 3, cached=2)))
        assert list(reply.response_trailers.header_mutation.remove_headers) == [TRAILER]
        await until(lambda: len(records) == 1, what="the call ended")
        (record,) = records
        assert (record.code, record.completion_tokens, record.cached_tokens) == ("OK", 3, 2)
        assert nothing_held(served)


async def test_interleaved_choices_have_every_message_kept() -> None:
    async with picker() as (_, channel, records):
        call, mark = await placed(channel, sgl_generate(tokens=3, n=2))
        assert mark == "all"
        frames = (
            answer("chunk", 1, index=0) + answer("complete", 3, 0) + answer("complete", 2, 0, 1)
        )
        await ended(call, kept(frames))
        await until(lambda: len(records) == 1, what="the call ended")
        assert records[0].completion_tokens == 5


@pytest.mark.parametrize(
    "trailer",
    [(), (kept(answer("complete", 3)[:-1]),), ((TRAILER, "not base64!"),)],
    ids=["none kept", "cut short", "garbled"],
)
async def test_no_usage_without_whole_messages(trailer: tuple[tuple[str, str], ...]) -> None:
    async with picker() as (served, channel, records):
        call, _ = await placed(channel, sgl_generate(tokens=3))
        await ended(call, *trailer)
        await until(lambda: len(records) == 1, what="the call ended")
        assert records[0].code == "OK" and records[0].completion_tokens is None
        assert nothing_held(served)


async def test_pieces_passing_the_picker_are_read_as_they_pass() -> None:
    async with picker() as (served, channel, records):
        call, mark = await placed(channel, sgl_generate(tokens=3), duplex=True)
        assert mark == ""  # Envoy keeps nothing: the body comes here
        body = answer("chunk", 1) + answer("chunk", 2, cached=1) + answer("complete", 3, 1)
        for piece in (body[:3], body[3:20], body[20:]):
            await call.write(
                ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=piece))
            )
            handed_back = await call.read()
            assert handed_back.response_body.response.body_mutation.streamed_response.body == piece
        # A trailer the worker sent is no copy of Envoy's: it is neither read nor removed.
        reply = await ended(call, kept(answer("complete", 99)))
        assert not reply.response_trailers.header_mutation.remove_headers
        await until(lambda: len(records) == 1, what="the call ended")
        assert (records[0].completion_tokens, records[0].cached_tokens) == (3, 1)
        assert nothing_held(served)


async def test_a_stream_the_client_left_counts_what_passed() -> None:
    async with picker() as (served, channel, records):
        call, _ = await placed(channel, sgl_generate(tokens=9), duplex=True)
        piece = answer("chunk", 2) + answer("chunk", 4)[:6]  # the second one cut short
        await call.write(ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=piece)))
        await call.read()
        assert served.answers.budget.held > 0
        call.cancel()  # Envoy reset the stream: no trailers
        await until(lambda: len(records) == 1, what="the call ended")
        assert records[0].code == "CANCELLED"
        assert records[0].completion_tokens == 2  # the relay counts what reached the client
        await until(lambda: nothing_held(served), what="nothing held")


async def test_other_rpcs_are_not_marked() -> None:
    async with picker() as (served, channel, _):
        call = process(channel)()
        await call.write(headers_part(EMBED, model_md("m")))
        await call.read()
        embed: Any = SGLANG.rpcs["Embed"].request_type(request_id="e")
        embed.tokenized.input_ids.extend([1, 2])
        await call.write(body_part(embed.SerializeToString()))
        named = await call.read()
        assert named.request_body.response.header_mutation.set_headers  # placed
        assert wire.PICKER_NAMESPACE not in named.dynamic_metadata.fields
        call.cancel()
        await until(lambda: nothing_held(served), what="nothing held")


async def test_a_tenants_tokens_are_settled_from_the_usage_read() -> None:
    """600 tokens a minute; each call reserves 3 + 256 (it does not say how much it may
    generate) and reports 5: settled from what was read, ten calls fit (at the estimate,
    the third would be refused)."""
    async with picker(tenants={"default": {"tokens_per_minute": 600}}) as (_, channel, records):
        for i in range(10):
            request = sgl_generate(f"c{i}")
            request.sampling_params.ClearField("max_new_tokens")
            call, mark = await placed(channel, request)
            assert mark == "last", i  # placed, not refused
            await ended(call, kept(answer("complete", 5)))
            await until(functools.partial(ended_calls, records, i + 1), what="the call ended")
        assert all(record.completion_tokens == 5 for record in records)
