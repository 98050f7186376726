"""The picker's side of the external processing protocol, as bytes Envoy reads."""

from __future__ import annotations

import base64

import grpc

from gateway.picker import wire
from gateway.picker.context import TrustedProxies, client_peer, timeout_s
from gateway.picker.destinations import endpoint, literal
from gateway.picker.v3 import base_pb2
from gateway.picker.v3 import external_processor_pb2 as ext_proc


def test_a_request_body_is_one_uncompressed_grpc_message_or_nothing() -> None:
    message = b"\x08\x01"
    assert wire.grpc_message(wire.framed(message)) == message
    assert wire.grpc_message(wire.framed(b"")) == b""
    assert wire.grpc_message(b"\x01" + wire.framed(message)[1:]) is None  # compressed
    assert wire.grpc_message(wire.framed(message) + wire.framed(message)) is None  # two
    assert wire.grpc_message(wire.framed(message)[:-1]) is None  # cut short
    assert wire.grpc_message(b"\0\0") is None


def test_headers_are_read_from_raw_values_or_values() -> None:
    header_map = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/a/B"),
            base_pb2.HeaderValue(key="x-old", value="v"),
        ]
    )
    assert wire.header_list(header_map) == ((":path", "/a/B"), ("x-old", "v"))


def test_grpc_status_of_trailers() -> None:
    assert wire.grpc_status([("grpc-status", "0")]) is grpc.StatusCode.OK
    assert wire.grpc_status([("x", "1"), ("grpc-status", "14")]) is grpc.StatusCode.UNAVAILABLE
    assert wire.grpc_status([("grpc-status", "99")]) is None
    assert wire.grpc_status([("grpc-status", "x")]) is None
    assert wire.grpc_status([]) is None


def test_the_destination_goes_in_the_header_and_the_lb_metadata() -> None:
    answer = ext_proc.ProcessingResponse.FromString(
        wire.destination("x-dest", "10.0.0.1:8000", ("authorization",), body=b"\x08\x02")
    )
    common = answer.request_body.response
    (option,) = common.header_mutation.set_headers
    assert (option.header.key, option.header.raw_value) == ("x-dest", b"10.0.0.1:8000")
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert list(common.header_mutation.remove_headers) == ["authorization"]
    assert common.body_mutation.body == wire.framed(b"\x08\x02")
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-dest"].string_value == "10.0.0.1:8000"
    unchanged = ext_proc.ProcessingResponse.FromString(wire.destination("x-dest", "1.2.3.4:5"))
    assert not unchanged.request_body.response.HasField("body_mutation")


def test_a_call_handed_to_the_relay_whole_asks_for_nothing_more() -> None:
    answer = ext_proc.ProcessingResponse.FromString(wire.whole_to("x-dest", "127.0.0.1:50051"))
    assert answer.WhichOneof("response") == "request_headers"
    mode = answer.mode_override
    assert mode.request_body_mode == mode.NONE
    assert mode.response_header_mode == mode.response_trailer_mode == mode.SKIP


def test_an_immediate_response_carries_the_status_message_and_trailers() -> None:
    details = b"\x08\x05\x12\x01x"
    answer = ext_proc.ProcessingResponse.FromString(
        wire.immediate(
            grpc.StatusCode.NOT_FOUND,
            "Model 'x' is not served",
            (("x-http-status", "404"), ("grpc-status-details-bin", details)),
        )
    )
    reply = answer.immediate_response
    assert reply.status.code == 200  # a gRPC answer: its status is grpc-status
    assert reply.grpc_status.status == grpc.StatusCode.NOT_FOUND.value[0]
    assert reply.body == "Model 'x' is not served"
    headers = {o.header.key: o.header.raw_value for o in reply.headers.set_headers}
    assert headers["x-http-status"] == b"404"
    # A -bin value goes as grpc metadata does on the wire: base64, unpadded.
    assert headers["grpc-status-details-bin"] == base64.b64encode(details).rstrip(b"=")


def test_the_answers_that_change_nothing_answer_their_part() -> None:
    for part, answer in wire.GO_ON.items():
        assert ext_proc.ProcessingResponse.FromString(answer).WhichOneof("response") == part


def test_grpc_timeouts() -> None:
    assert timeout_s("10S") == 10.0
    assert timeout_s("250m") == 0.25
    assert timeout_s("2H") == 7200.0
    assert timeout_s("5") is None
    assert timeout_s("123456789S") is None  # over 8 digits
    assert timeout_s("-1S") is None


def test_the_clients_address_is_the_one_a_trusted_envoy_saw() -> None:
    own = "ipv4:127.0.0.1:5000"
    envoy = TrustedProxies(["127.0.0.1"])
    assert client_peer([("x-envoy-external-address", "10.1.2.3")], own, envoy) == (
        "ipv4:10.1.2.3:0"
    )
    assert client_peer([("x-forwarded-for", "1.1.1.1, 10.0.0.9")], own, envoy) == (
        "ipv4:10.0.0.9:0"
    )
    assert client_peer([("x-envoy-external-address", "::1")], own, envoy) == "ipv6:[::1]:0"
    assert client_peer([], own, envoy) == own
    # past the trusted hops, to the first that is not one
    chain = TrustedProxies(["127.0.0.1", "10.0.0.0/8"])
    hops = [("x-forwarded-for", "9.9.9.9, 8.8.8.8, 10.0.0.7, 127.0.0.1")]
    assert client_peer(hops, own, chain) == "ipv4:8.8.8.8:0"
    # not an address: the stream's own peer
    assert client_peer([("x-forwarded-for", "evil")], own, envoy) == own
    assert client_peer([("x-envoy-external-address", "a" * 5000)], own, envoy) == own


def test_forwarding_headers_from_an_untrusted_peer_name_nobody() -> None:
    """Anyone reaching the picker port could otherwise rotate its address past the
    failure block, or pose as another client."""
    own = "ipv4:192.0.2.5:5000"
    spoof = [("x-forwarded-for", "127.0.0.1"), ("x-envoy-external-address", "10.9.9.9")]
    assert client_peer(spoof, own, TrustedProxies()) == own
    assert client_peer(spoof, own, TrustedProxies(["127.0.0.1"])) == own
    mapped = "ipv6:[::ffff:127.0.0.1]:5000"  # Envoy over a dual-stack socket
    assert client_peer(spoof, mapped, TrustedProxies(["127.0.0.0/8"])) == "ipv4:10.9.9.9:0"


def test_destinations_are_addresses() -> None:
    assert literal("10.0.0.1") == "10.0.0.1"
    assert literal("[::1]") == "::1"
    assert literal("worker-0.svc") is None
    assert endpoint("10.0.0.1", 80) == "10.0.0.1:80"
    assert endpoint("::1", 80) == "[::1]:80"


def _first_part(request_body_mode: int, response_body_mode: int) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(),
        protocol_config=ext_proc.ProtocolConfiguration(
            request_body_mode=request_body_mode,  # type: ignore[arg-type]
            response_body_mode=response_body_mode,  # type: ignore[arg-type]
        ),
    )


def test_body_modes_come_from_the_streams_first_part() -> None:
    mode = wire.Mode
    assert wire.modes(ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders())) == (
        wire.DEFAULT_MODES
    )
    duplex = wire.modes(_first_part(mode.FULL_DUPLEX_STREAMED, mode.FULL_DUPLEX_STREAMED))
    assert duplex == wire.Modes(placeable=True, request_duplex=True, response_duplex=True)
    assert wire.modes(_first_part(mode.BUFFERED_PARTIAL, mode.NONE)) == wire.DEFAULT_MODES
    assert not wire.modes(_first_part(mode.STREAMED, mode.NONE)).placeable  # routed first
    assert not wire.modes(_first_part(mode.NONE, mode.NONE)).placeable


def test_in_full_duplex_every_body_piece_is_handed_back_as_it_came() -> None:
    duplex = wire.Modes(request_duplex=True, response_duplex=True)
    piece = ext_proc.ProcessingRequest(
        response_body=ext_proc.HttpBody(body=b"\0\0\0\0\1x", end_of_stream=True)
    )
    answer = ext_proc.ProcessingResponse.FromString(wire.go_on(piece, duplex))
    streamed = answer.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"\0\0\0\0\1x", True)
    assert wire.go_on(piece, wire.DEFAULT_MODES) == wire.GO_ON_RESPONSE_BODY
    trailers = ext_proc.ProcessingRequest(response_trailers=ext_proc.HttpTrailers())
    assert wire.go_on(trailers, duplex) == wire.GO_ON_RESPONSE_TRAILERS


def test_in_full_duplex_the_headers_answer_names_the_destination() -> None:
    answer = ext_proc.ProcessingResponse.FromString(
        wire.headers_to("x-dest", "10.0.0.1:8000", ("authorization",))
    )
    mutation = answer.request_headers.response.header_mutation
    assert [(h.header.key, h.header.raw_value) for h in mutation.set_headers] == [
        ("x-dest", b"10.0.0.1:8000")
    ]
    assert list(mutation.remove_headers) == ["authorization"]
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-dest"].string_value == "10.0.0.1:8000"
    assert not answer.HasField("mode_override")  # pieces of the body may be on their way


def _headers(count: int, value: bytes = b"") -> ext_proc.ProcessingRequest:
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=f"x{i}", raw_value=value) for i in range(count)]
    )
    return ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=header_map))


def test_a_body_is_outside_the_envelope_and_headers_are_in_it() -> None:
    body = ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=b"b" * 500_000, end_of_stream=True)
    )
    assert wire.envelope_bytes(body.SerializeToString()) == 0
    headers = _headers(10).SerializeToString()
    assert wire.envelope_bytes(headers) == len(headers)
    assert isinstance(wire.parse(body.SerializeToString()), ext_proc.ProcessingRequest)


def test_headers_past_the_bounds_are_refused_unparsed_or_counted() -> None:
    big = wire.parse(_headers(100, b"v" * 1024).SerializeToString())  # ~100 KiB
    assert isinstance(big, wire.Oversized) and "bytes" in big.detail
    many = wire.parse(_headers(wire.MAX_HEADERS + 1).SerializeToString())
    assert isinstance(many, wire.Oversized) and f"{wire.MAX_HEADERS + 1} headers" in many.detail
    assert isinstance(
        wire.parse(_headers(wire.MAX_HEADERS).SerializeToString()), ext_proc.ProcessingRequest
    )


def test_a_message_of_many_top_level_fields_is_not_scanned_past_a_handful() -> None:
    fields = b"\x18\x01" * (wire.MAX_FIELDS + 1)  # an unknown varint field, again and again
    assert wire.envelope_bytes(fields) is None
    assert isinstance(wire.parse(fields), wire.Oversized)
    assert wire.envelope_bytes(b"\x12\x7f") is None  # a record cut short
