"""One call Envoy relays, seen through its external processing stream: the stand-in for
a grpc ServicerContext that the relay's stages read (metadata, peer, deadline, the
request message) and end (abort), so a call passes the same stages, and gets the same
verdicts, whichever way it came."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Awaitable, Sequence
from typing import Any, NoReturn

import grpc
from grpc import aio

from gateway.core.address import IpAddress, peer_host, unmapped
from gateway.picker import wire
from gateway.picker.v3 import external_processor_pb2 as ext_proc
from gateway.proxy import Call, Metadata

TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
MAX_TIMEOUT_DIGITS = 8  # the gRPC spec's bound on grpc-timeout's value
MAX_HOPS = 16  # x-forwarded-for entries read, from the right: a long list costs nothing
# Headers that are the call's transport, not its metadata (grpc gives a servicer none of
# them either); pseudo-headers (`:path`) are left out too.
TRANSPORT = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "content-length"})


class Answered(Exception):
    """The call was answered by the picker itself (a verdict, an invalid request): the
    answer to send Envoy, an ImmediateResponse."""

    def __init__(self, code: grpc.StatusCode, answer: bytes) -> None:
        super().__init__(code.name)
        self.code = code
        self.answer = answer


def timeout_s(value: str) -> float | None:
    """A `grpc-timeout` header's seconds (`10S`, `250m`); None if it is not one."""
    digits, unit = value[:-1], value[-1:]
    scale = TIMEOUT_UNITS.get(unit)
    if scale is None or not digits.isdigit() or len(digits) > MAX_TIMEOUT_DIGITS:
        return None
    return int(digits) * scale


class TrustedProxies:
    """Peers whose forwarding headers are believed (`picker.trusted_proxies`)."""

    __slots__ = ("_networks",)

    def __init__(self, ranges: Sequence[str] = ()) -> None:
        self._networks = tuple(ipaddress.ip_network(r, strict=False) for r in ranges)

    def __bool__(self) -> bool:
        return bool(self._networks)

    def __contains__(self, host: str) -> bool:
        address = ip_of(host)
        return address is not None and any(address in n for n in self._networks)


def ip_of(host: str) -> IpAddress | None:
    """`host` as an address (an IPv4-mapped IPv6 one as IPv4), None if it is none."""
    try:
        return unmapped(ipaddress.ip_address(host.strip().strip("[]")))
    except ValueError:
        return None


def client_peer(
    headers: Sequence[tuple[str, str]], stream_peer: str, trusted: TrustedProxies
) -> str:
    """The client's address as grpc would name it. From a trusted proxy (Envoy), the one
    it saw: `x-envoy-external-address` (with `use_remote_address` Envoy sets it, removing
    any a client sent), else `x-forwarded-for` read from the right past the trusted hops;
    from anyone else, or with no valid address there, the stream's own peer: a header
    anyone may send names nobody."""
    if not trusted or peer_host(stream_peer) not in trusted:
        return stream_peer
    external = forwarded = ""
    for key, value in headers:
        if key == "x-envoy-external-address":
            external = value
        elif key == "x-forwarded-for":
            forwarded = value
    hops = [hop for hop in forwarded.split(",")[-MAX_HOPS:] if hop.strip()]
    found = ip_of(external) if external.strip() else None
    for hop in reversed(hops if found is None else ()):
        found = ip_of(hop)
        if found is None or str(found) not in trusted:
            break
    if found is None:
        return stream_peer
    return f"ipv6:[{found}]:0" if found.version == 6 else f"ipv4:{found}:0"


class PickerContext:
    """What the stages ask of a call's context, answered from the external processing
    stream: the request headers as its metadata, the request body as its one message,
    the `grpc-timeout` as its deadline; `abort` raises `Answered` with the answer. It
    also sends the call on (`go_to`), as the filter's body mode needs."""

    __slots__ = (
        "_body",
        "_code",
        "_deadline",
        "_ended",
        "_header",
        "_max_body",
        "_metadata",
        "_peer",
        "_trailers",
        "bodiless",
        "headers",
        "modes",
        "stream",
    )

    def __init__(
        self,
        stream: aio.ServicerContext,
        headers: wire.Headers,
        header: str,
        modes: wire.Modes,
        max_body: int,
        trusted: TrustedProxies,
        bodiless: bool = False,
    ) -> None:
        self.stream = stream
        self.bodiless = bodiless  # the headers ended the request
        self.headers = headers
        self.modes = modes
        self._header = header  # where the destination is named
        self._max_body = max_body  # the most of a body read: a longer one is the relay's
        self._metadata: tuple[tuple[str, str], ...] = tuple(
            (k, v) for k, v in headers if not k.startswith(":") and k not in TRANSPORT
        )
        deadline = None
        for key, value in headers:
            if key == "grpc-timeout":
                left = timeout_s(value)
                deadline = None if left is None else time.monotonic() + left
        self._deadline = deadline
        self._peer = client_peer(headers, stream.peer(), trusted)
        self._code: grpc.StatusCode | None = None
        self._body = b""  # FULL_DUPLEX_STREAMED: the body read, Envoy holds none of it
        self._ended = bodiless  # ... and it was the whole body
        self._trailers = False  # ... and the request's trailers came after it

    # -- read by the stages ---------------------------------------------------------------

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, Any]:
        return {}  # the client's TLS ends at Envoy: no certificate reaches the picker

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def code(self) -> grpc.StatusCode | None:
        return self._code

    async def read(self) -> Any:
        """The request message (EOF if the request had none, or the stream ended);
        `Unreadable` if the body is not one uncompressed message of at most the bound,
        or was cut short (BUFFERED_PARTIAL past Envoy's buffer): the relay's to read."""
        if self.modes.request_duplex:
            return await self._read_pieces()
        while True:
            request = await self._request_part()
            part = _part(request)
            if request is not None and part == "request_body":
                return self._message(request.request_body.body)
            if part != "request_trailers":
                return aio.EOF
            await self.stream.write(wire.GO_ON_REQUEST_TRAILERS)

    async def _read_pieces(self) -> Any:
        """FULL_DUPLEX_STREAMED: the body's pieces, up to its end or the bound; Envoy
        waits for the answer to the headers until the picker has read them."""
        pieces: list[bytes] = []
        size = 0
        while True:
            request = await self._request_part()
            part = _part(request)
            if part == "request_trailers":
                self._trailers = True
                break
            if request is None or part != "request_body":
                return aio.EOF
            piece = request.request_body
            pieces.append(piece.body)
            size += len(piece.body)
            if piece.end_of_stream:
                self._ended = True
                break
            if size > self._max_body:
                break
        self._body = b"".join(pieces)
        if not (self._ended or self._trailers):
            raise Unreadable()  # past the bound: the relay reads it as it comes
        return self._message(self._body)

    def _message(self, body: bytes) -> bytes:
        message = wire.grpc_message(body) if len(body) <= self._max_body else None
        if message is None:
            raise Unreadable()
        return message

    async def next_part(self) -> ext_proc.ProcessingRequest | wire.Oversized | None:
        """The stream's next part (None: Envoy closed it)."""
        request = await self.stream.read()
        return None if request is aio.EOF else request

    async def _request_part(self) -> ext_proc.ProcessingRequest | None:
        """The request's next part; one past the bounds ends the call (RESOURCE_EXHAUSTED,
        as grpc answers headers too large on the main port)."""
        request = await self.next_part()
        if isinstance(request, wire.Oversized):
            await self.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Request headers too large for the gateway: {request.detail}",
                (("x-http-status", "431"),),
            )
        return request

    async def hand_back(self) -> None:
        """FULL_DUPLEX_STREAMED: what is left of the request's body after what was read,
        handed back as it comes, up to its end."""
        await hand_back(self.stream, self.modes, self._ended or self._trailers)

    async def answer(self, answer: bytes) -> None:
        await self.stream.write(answer)

    # -- what sends it on -----------------------------------------------------------------

    async def headers_read(self) -> None:
        """The headers are read: Envoy may send the body (in FULL_DUPLEX_STREAMED it does
        without asking, and the headers' answer names the destination: `go_to`)."""
        if not self.modes.request_duplex:
            await self.stream.write(wire.GO_ON_REQUEST_HEADERS)

    async def go_to(
        self,
        address: str,
        remove: tuple[str, ...] = (),
        body: bytes | None = None,
        *,
        mark: bytes = b"",
    ) -> None:
        """Send the call to `address` (`IP:PORT`), without the `remove` headers, with
        `body` as its request message if given, `mark` added to the answer (metadata for
        Envoy's filters: `wire.metadata_patch`): the answer to the body (the headers are
        still Envoy's to change); in FULL_DUPLEX_STREAMED, the answer to the headers,
        then the body handed back (and the request's trailers, if they came)."""
        if not self.modes.request_duplex:
            await self.stream.write(wire.destination(self._header, address, remove, body) + mark)
            return
        write = self.stream.write
        await write(wire.headers_to(self._header, address, remove) + mark)
        sent = self._body if body is None else wire.framed(body)
        await write(wire.streamed("request_body", sent, self._ended))
        if self._trailers:
            await write(wire.GO_ON_REQUEST_TRAILERS)

    # -- what a relay's client side does: never here ---------------------------------------

    def write(self, message: bytes) -> Awaitable[None]:
        raise RelayedByEnvoy()

    async def send_initial_metadata(self, metadata: Metadata) -> None:
        raise RelayedByEnvoy()

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        raise RelayedByEnvoy()

    # -- what ends it ---------------------------------------------------------------------

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: wire.Trailers = ()
    ) -> NoReturn:
        self._code = code
        raise Answered(code, wire.immediate(code, details, trailing_metadata))


async def hand_back(stream: aio.ServicerContext, modes: wire.Modes, ended: bool) -> None:
    """FULL_DUPLEX_STREAMED: the rest of the request's body handed back as it comes
    (Envoy keeps none of a body it sent), up to its end (`ended`: it has come). Then the
    stream may end: a closed stream tells Envoy nothing more of the call needs the
    picker."""
    while modes.request_duplex and not ended:
        request = await stream.read()
        if not isinstance(request, ext_proc.ProcessingRequest):
            return
        await stream.write(wire.go_on(request, modes))
        ended = _part(request) != "request_body" or request.request_body.end_of_stream


def _part(request: ext_proc.ProcessingRequest | None) -> str:
    """Which part of the call `request` is ("" once the stream has ended)."""
    return "" if request is None else request.WhichOneof("request") or ""


class ToRelay(Exception):
    """The call is the relay's to run whole (a disaggregated pair, a migratable stream)."""


def picker_context(call: Call) -> PickerContext:
    """The context of a call that came through the picker."""
    context = call.context
    assert isinstance(context, PickerContext)
    return context


class RelayedByEnvoy(Exception):
    """Envoy relays the worker's answer to the client: the picker writes none of it."""


class Unreadable(Exception):
    """The body is not one uncompressed gRPC message: the relay reads it itself."""
