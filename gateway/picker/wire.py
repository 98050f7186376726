"""The picker's side of Envoy's external processing protocol, as small pure functions:
headers read from Envoy's header maps, the gRPC message cut out of a buffered body, and
every answer the picker sends, built as bytes (the constant ones once)."""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from gateway.core.wire import LENGTH_DELIMITED, records
from gateway.picker.v3 import base_pb2, http_status_pb2, processing_mode_pb2
from gateway.picker.v3 import external_processor_pb2 as ext_proc

Headers = tuple[tuple[str, str], ...]
Trailers = Sequence[tuple[str, str | bytes]]

FRAME_HEADER = 5  # a gRPC message: a compressed flag, a 4-byte length, the message
LB_NAMESPACE = "envoy.lb"  # dynamic metadata Envoy's load balancers read
PICKER_NAMESPACE = "gateway.picker"  # dynamic metadata for Envoy's filters after the picker's
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
Mode = processing_mode_pb2.ProcessingMode

CODES = {code.value[0]: code for code in grpc.StatusCode}


def _answer(**part: object) -> bytes:
    return ext_proc.ProcessingResponse(**part).SerializeToString()  # type: ignore[arg-type]


# The answers that change nothing, one per part of the call (built once).
GO_ON_REQUEST_HEADERS = _answer(request_headers=ext_proc.HeadersResponse())
GO_ON_REQUEST_BODY = _answer(request_body=ext_proc.BodyResponse())
GO_ON_RESPONSE_HEADERS = _answer(response_headers=ext_proc.HeadersResponse())
GO_ON_RESPONSE_BODY = _answer(response_body=ext_proc.BodyResponse())
GO_ON_REQUEST_TRAILERS = _answer(request_trailers=ext_proc.TrailersResponse())
GO_ON_RESPONSE_TRAILERS = _answer(response_trailers=ext_proc.TrailersResponse())
GO_ON = {
    "request_headers": GO_ON_REQUEST_HEADERS,
    "request_body": GO_ON_REQUEST_BODY,
    "response_headers": GO_ON_RESPONSE_HEADERS,
    "response_body": GO_ON_RESPONSE_BODY,
    "request_trailers": GO_ON_REQUEST_TRAILERS,
    "response_trailers": GO_ON_RESPONSE_TRAILERS,
}

# A call handed to the relay whole: nothing more of it is sent to the picker.
NOTHING_MORE = Mode(
    request_body_mode=Mode.NONE,
    request_trailer_mode=Mode.SKIP,
    response_header_mode=Mode.SKIP,
    response_body_mode=Mode.NONE,
    response_trailer_mode=Mode.SKIP,
)


@dataclass(frozen=True, slots=True)
class Modes:
    """How the filter sends a call's bodies, as Envoy says on the stream's first part
    (an Envoy that does not say: the modes `gateway envoy-config` sets). A request body
    the picker sees before the call is routed (BUFFERED, BUFFERED_PARTIAL, or
    FULL_DUPLEX_STREAMED) is what placement reads; in FULL_DUPLEX_STREAMED Envoy keeps
    nothing of a body it sent, so the picker hands every piece back."""

    placeable: bool = True  # the request body comes before the call is routed
    request_duplex: bool = False
    response_duplex: bool = False


DEFAULT_MODES = Modes()
PLACEABLE = frozenset({Mode.BUFFERED, Mode.BUFFERED_PARTIAL, Mode.FULL_DUPLEX_STREAMED})


def modes(request: ext_proc.ProcessingRequest) -> Modes:
    """The body modes of the stream whose first part is `request`."""
    if not request.HasField("protocol_config"):
        return DEFAULT_MODES
    config = request.protocol_config
    return Modes(
        placeable=config.request_body_mode in PLACEABLE,
        request_duplex=config.request_body_mode == Mode.FULL_DUPLEX_STREAMED,
        response_duplex=config.response_body_mode == Mode.FULL_DUPLEX_STREAMED,
    )


def go_on(request: ext_proc.ProcessingRequest, modes: Modes) -> bytes:
    """The answer that changes nothing to a part of the call: in FULL_DUPLEX_STREAMED,
    a body piece handed back as it came."""
    part = request.WhichOneof("request") or ""
    if part == "request_body" and modes.request_duplex:
        return streamed(
            "request_body", request.request_body.body, request.request_body.end_of_stream
        )
    if part == "response_body" and modes.response_duplex:
        body = request.response_body
        return streamed("response_body", body.body, body.end_of_stream)
    return GO_ON.get(part, b"")


def streamed(part: str, body: bytes, end: bool) -> bytes:
    """The answer to a body piece in FULL_DUPLEX_STREAMED: the bytes Envoy sends on."""
    mutation = ext_proc.BodyMutation(
        streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end)
    )
    return _answer(
        **{part: ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))}
    )


def header_list(header_map: base_pb2.HeaderMap) -> Headers:
    """Envoy's headers as (key, value) text pairs (it sends values in `raw_value`; older
    Envoys in `value`)."""
    return tuple(
        (h.key, h.raw_value.decode("latin-1") if h.raw_value else h.value)
        for h in header_map.headers
    )


def grpc_message(body: bytes) -> bytes | None:
    """The one uncompressed gRPC message of a request body, else None (a compressed or
    partial message, or several: the relay reads those itself)."""
    if len(body) < FRAME_HEADER or body[0] != 0:
        return None
    length = int.from_bytes(body[1:FRAME_HEADER], "big")
    if len(body) != FRAME_HEADER + length:
        return None
    return body[FRAME_HEADER:]


def framed(message: bytes) -> bytes:
    """`message` as the one gRPC message of a body."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def grpc_status(headers: Iterable[tuple[str, str]]) -> grpc.StatusCode | None:
    """The `grpc-status` of a response's trailers (or of a Trailers-Only answer's
    headers); None when there is none, or it is not a status."""
    for key, value in headers:
        if key == "grpc-status":
            return CODES.get(int(value)) if value.isdigit() else None
    return None


def _header(key: str, value: str | bytes) -> base_pb2.HeaderValueOption:
    """A header set as gRPC metadata goes on the wire: a `-bin` value base64, unpadded."""
    if isinstance(value, str):
        raw = value.encode("latin-1")
    else:
        raw = base64.b64encode(value).rstrip(b"=")
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=raw), append_action=OVERWRITE
    )


def _metadata(header: str, address: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[header] = address
    return metadata


def destination(
    header: str, address: str, remove: tuple[str, ...] = (), body: bytes | None = None
) -> bytes:
    """The answer to a request's buffered body: go to `address` (`IP:PORT`), in `header`
    and in the `envoy.lb` dynamic metadata; `remove`: headers that must not go upstream;
    `body`: a new request message (the request as the worker gets it). Without a body,
    the answer is the same for every call to a worker: built once."""
    if body is None:
        return _destination(header, address, remove)
    return _build_destination(header, address, remove, body)


@functools.lru_cache(maxsize=4096)
def _destination(header: str, address: str, remove: tuple[str, ...]) -> bytes:
    return _build_destination(header, address, remove, None)


def _build_destination(
    header: str, address: str, remove: tuple[str, ...], body: bytes | None
) -> bytes:
    response = _to(header, address, remove)
    if body is not None:
        response.body_mutation.body = framed(body)
    return _answer(
        request_body=ext_proc.BodyResponse(response=response),
        dynamic_metadata=_metadata(header, address),
    )


def _to(header: str, address: str, remove: tuple[str, ...] = ()) -> ext_proc.CommonResponse:
    return ext_proc.CommonResponse(
        header_mutation=ext_proc.HeaderMutation(
            set_headers=[_header(header, address)], remove_headers=remove
        )
    )


@functools.lru_cache(maxsize=4096)
def headers_to(header: str, address: str, remove: tuple[str, ...] = ()) -> bytes:
    """The answer to a request's headers that sends the call to `address`: in
    FULL_DUPLEX_STREAMED the headers wait for the body, so the destination goes there
    (the same for every call to a worker: built once)."""
    return _answer(
        request_headers=ext_proc.HeadersResponse(response=_to(header, address, remove)),
        dynamic_metadata=_metadata(header, address),
    )


def metadata_patch(values: dict[str, str]) -> bytes:
    """`values` in the `gateway.picker` dynamic metadata, as a patch: appended to an
    answer's bytes, it adds them to the answer's dynamic metadata (protobuf merges)."""
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(PICKER_NAMESPACE).update(values)
    return _answer(dynamic_metadata=metadata)


@functools.lru_cache(maxsize=16)
def trailers_without(name: str) -> bytes:
    """The answer to a response's trailers that removes one of them (built once)."""
    mutation = ext_proc.HeaderMutation(remove_headers=[name])
    return _answer(response_trailers=ext_proc.TrailersResponse(header_mutation=mutation))


def whole_to(header: str, address: str) -> bytes:
    """The answer to a request's headers that hands the whole call to `address` (the
    relay): nothing more of the call comes to the picker. (Not in FULL_DUPLEX_STREAMED:
    pieces of the body may be on their way already, and the picker must hand them
    back: `headers_to`.)"""
    return _answer(
        request_headers=ext_proc.HeadersResponse(response=_to(header, address)),
        dynamic_metadata=_metadata(header, address),
        mode_override=NOTHING_MORE,
    )


def immediate(code: grpc.StatusCode, message: str, trailers: Trailers) -> bytes:
    """An answer that ends the call at once, as the relay would have ended it: a gRPC
    call gets HTTP 200 and Trailers-Only (`grpc-status`, `message` as `grpc-message`,
    and `trailers`)."""
    return _answer(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=http_status_pb2.OK),
            headers=ext_proc.HeaderMutation(set_headers=[_header(k, v) for k, v in trailers]),
            body=message,
            grpc_status=ext_proc.GrpcStatus(status=code.value[0]),
            details="gateway_picker_verdict",
        )
    )


# -- what Envoy may send ---------------------------------------------------------------

# Bounds on a message's parts other than a body (its headers, trailers, protocol config):
# Envoy's own default limits on a request's headers are 60 KiB and 100 headers; past
# these, reading them would cost the event loop milliseconds per message.
MAX_HEADER_BYTES = 96 * 1024
MAX_HEADERS = 1024
MAX_FIELDS = 16  # top-level fields scanned: Envoy sends at most a handful
BODIES = frozenset({4, 5})  # request_body, response_body: bounded by the message length
HEADER_PARTS = ("request_headers", "response_headers")
TRAILER_PARTS = ("request_trailers", "response_trailers")


class Oversized:
    """A message whose headers are past the bounds, left unparsed (its `detail` says
    which bound)."""

    __slots__ = ("detail",)

    def __init__(self, detail: str) -> None:
        self.detail = detail


def envelope_bytes(raw: bytes) -> int | None:
    """The bytes of a ProcessingRequest outside its body, read off the top-level records
    without parsing them; None past MAX_FIELDS records, or on bytes that are no records
    (the parser then decides)."""
    size = 0
    try:
        for count, (number, kind, start, end) in enumerate(records(raw, 0, len(raw)), 1):
            if count > MAX_FIELDS:
                return None
            if kind != LENGTH_DELIMITED or number not in BODIES:
                size += end - start
    except DecodeError:
        return None
    return size


def parse(raw: bytes) -> ext_proc.ProcessingRequest | Oversized:
    """A message from Envoy (the picker port's deserializer): its headers' bytes bounded
    before it is parsed, their number after (counting them costs nothing once parsed)."""
    envelope = envelope_bytes(raw)
    if envelope is None:
        return Oversized(f"more than {MAX_FIELDS} fields, or no message at all")
    if envelope > MAX_HEADER_BYTES:
        return Oversized(f"headers past {MAX_HEADER_BYTES} bytes")
    request = ext_proc.ProcessingRequest.FromString(raw)
    part = request.WhichOneof("request")
    if part in HEADER_PARTS:
        count = len(getattr(request, part).headers.headers)
    elif part in TRAILER_PARTS:
        count = len(getattr(request, part).trailers.headers)
    else:
        count = 0
    if count > MAX_HEADERS:
        return Oversized(f"{count} headers, past {MAX_HEADERS}")
    return request
