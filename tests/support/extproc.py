"""Speaking Envoy's side of the picker's ext_proc stream (a raw client, the picker's own
generated messages): a call's parts as Envoy sends them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from grpc import aio

from gateway.picker import wire
from gateway.picker.service import SERVICE
from gateway.picker.v3 import base_pb2
from gateway.picker.v3 import external_processor_pb2 as ext_proc

Headers = Sequence[tuple[str, str | bytes]]


def header_map(pairs: Headers) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v if isinstance(v, bytes) else v.encode())
            for k, v in pairs
        ]
    )


def headers_part(
    path: str, extra: Headers = (), *, end: bool = False
) -> ext_proc.ProcessingRequest:
    """A call's request headers (gRPC's content type, and `extra`)."""
    pairs = [(":path", path), ("content-type", "application/grpc"), *extra]
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=header_map(pairs), end_of_stream=end)
    )


def body_part(message: bytes) -> ext_proc.ProcessingRequest:
    """A buffered request body: the one gRPC message, whole."""
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=wire.framed(message), end_of_stream=True)
    )


def response_headers_part() -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=header_map([(":status", "200")]))
    )


def trailers_part(status: int = 0) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        response_trailers=ext_proc.HttpTrailers(trailers=header_map([("grpc-status", str(status))]))
    )


def process(ch: aio.Channel) -> aio.StreamStreamMultiCallable:
    """The picker's one method."""
    return ch.stream_stream(
        f"/{SERVICE}/Process",
        request_serializer=ext_proc.ProcessingRequest.SerializeToString,
        response_deserializer=ext_proc.ProcessingResponse.FromString,
    )


async def placed_call(ch: aio.Channel, path: str, request: bytes, metadata: Headers) -> str:
    """One call through the picker as Envoy runs it when the worker answers OK: the
    destination the picker named."""
    call = process(ch)()
    await call.write(headers_part(path, metadata))
    await call.read()
    await call.write(body_part(request))
    placed = await call.read()
    mutation = placed.request_body.response.header_mutation
    await call.write(response_headers_part())
    await call.read()
    await call.write(trailers_part())
    await call.read()
    assert await call.read() is aio.EOF
    return str(mutation.set_headers[0].header.raw_value.decode())


def cut(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    """`data` in pieces, cut at `cuts` (any positions, in any order; a repeat makes an
    empty piece), as Envoy may hand a body over."""
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]
