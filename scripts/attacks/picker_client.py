"""Envoy's external processing protocol (`envoy.service.ext_proc.v3.ExternalProcessor/
Process`) as a client that is no Envoy speaks it to the picker's port: a call's headers
and body as ProcessingRequests, a stream, what the picker's answers say; and the base of
the picker scenarios (the gateway's picker on loopback, connections "from" another
loopback address)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from grpc import aio

from gateway.picker.service import SERVICE as PICKER_SERVICE
from gateway.picker.v3 import base_pb2, processing_mode_pb2
from gateway.picker.v3 import external_processor_pb2 as ext_proc
from gateway.picker.wire import CODES, framed
from gateway_sim.launch import Child
from scripts.attacks.harness import Scenario

PROCESS = f"/{PICKER_SERVICE}/Process"
SGL_GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
DESTINATION = "x-gateway-destination-endpoint"  # picker.header's default
LOOPBACK_PICKER = {"listen": "127.0.0.1:0"}
Mode = processing_mode_pb2.ProcessingMode
WAIT_S = 20.0  # bound on every wait for the state an attack leaves
ANSWER_S = 10.0  # bound on one answer of the picker


def header_map(pairs: Sequence[tuple[str, str]]) -> base_pb2.HeaderMap:
    """Headers as Envoy sends them (values in `raw_value`)."""
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")) for k, v in pairs]
    )


def call_headers(path: str, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    """A gRPC call's request headers as Envoy forwards them to its filter."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", "gateway"),
        (":path", path),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]


def headers_part(
    path: str, *extra: tuple[str, str], body_mode: int | None = None
) -> ext_proc.ProcessingRequest:
    """A stream's first part: the request's headers (a body follows), with the filter's
    body mode if given (none: the modes `gateway envoy-config` sets)."""
    request = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=header_map(call_headers(path, *extra)), end_of_stream=False
        )
    )
    if body_mode is not None:
        request.protocol_config.request_body_mode = body_mode  # type: ignore[assignment]
    return request


def body_part(message: bytes) -> ext_proc.ProcessingRequest:
    """The request's buffered body: one gRPC message, whole."""
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=framed(message), end_of_stream=True)
    )


def serialized(message: Any) -> bytes:
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


def open_stream(ch: aio.Channel) -> Any:
    """One ext_proc stream, written and read part by part (a request serialized already
    is sent as it is)."""
    process = ch.stream_stream(
        PROCESS,
        request_serializer=serialized,
        response_deserializer=ext_proc.ProcessingResponse.FromString,
    )
    return process()


def answered(response: ext_proc.ProcessingResponse) -> str:
    """What an answer of the picker is: its part, or an ImmediateResponse and its code."""
    part = response.WhichOneof("response")
    if part == "immediate_response":
        status = response.immediate_response.grpc_status.status
        code = CODES.get(status)
        return f"ImmediateResponse {code.name if code else status}"
    return part or "empty answer"


def destination_of(response: ext_proc.ProcessingResponse) -> str | None:
    """The worker a body's answer names, if it names one."""
    if response.WhichOneof("response") != "request_body":
        return None
    for option in response.request_body.response.header_mutation.set_headers:
        if option.header.key == DESTINATION:
            return bytes(option.header.raw_value).decode() or option.header.value
    return None


async def to_the_end(stream: Any, answers: list[str]) -> str:
    """Every further answer of a stream (kept in `answers`) until it ends: how it ended,
    the last answer and the stream's status."""
    try:
        while True:
            response = await stream.read()
            if response is aio.EOF:
                break
            answers.append(answered(response))
    except aio.AioRpcError as error:
        return f"stream error {error.code().name}"
    code = await stream.code()
    last = answers[-1] if answers else "no answer"
    return f"{last}, then stream {code.name}"


def seconds(values: Sequence[float]) -> str:
    return f"{max(values):.1f} s" if values else "-"


class PickerScenario(Scenario):
    """A scenario whose attacker speaks ext_proc to the picker's port."""

    def picker(self) -> str:
        assert self.run.gw is not None
        return str(self.run.gw.extra["picker"])

    def gateway(self, config: dict[str, Any], *workers: str) -> Child:
        config = {**config, "picker": {**LOOPBACK_PICKER, **config.get("picker", {})}}
        return self.run.gateway(config, *workers)

    async def from_host(self, host: str) -> aio.Channel:
        """A connection to the picker whose peer is `host` (a loopback address other than
        the legitimate client's 127.0.0.1): through a relay of bytes in this process
        whose connections to the gateway are bound to `host`."""
        picker_host, _, picker_port = self.picker().rpartition(":")
        links: list[asyncio.StreamWriter] = []

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            links.append(writer)
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    picker_host, int(picker_port), local_addr=(host, 0)
                )
            except OSError:
                writer.close()
                return
            links.append(up_writer)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        server = await asyncio.start_server(link, "127.0.0.1", 0)

        def close() -> None:
            server.close()
            for writer in links:
                writer.close()

        self.run.on_exit(close)
        port = server.sockets[0].getsockname()[1]
        return self.run.channel(f"127.0.0.1:{port}")
