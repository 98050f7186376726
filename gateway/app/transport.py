"""The main port's transport options: grpc core's limits on connections, streams and
messages, and how much a client may send ahead on a stream the front has not read yet."""

from __future__ import annotations

from gateway.config import GatewayConfig
from gateway.picker.wire import MAX_HEADER_BYTES

REQUEST_WINDOW_BYTES = 64 * 1024  # what a client may send ahead on a stream not read yet
# What an external processing message carries beside a request body: the call's headers
# (bounded by the picker, `picker.wire.MAX_HEADER_BYTES`), and protobuf's framing.
PICKER_ENVELOPE_BYTES = MAX_HEADER_BYTES + 4096


def server_options(config: GatewayConfig, shared: bool = False) -> list[tuple[str, int]]:
    """The main port's transport limits (see `LimitsConfig`); SO_REUSEPORT only when the
    port is `shared` by serving processes, so one process alone refuses a busy port."""
    limits = config.limits
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 1 if shared else 0),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        # Connections past it are closed by grpc core as they arrive.
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        # A stream whose request the front does not read yet is held to one fixed stream
        # window (BDP probing would grow every stream's window to megabytes): see intake.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", REQUEST_WINDOW_BYTES),
    ]
    if limits.connection_idle_timeout_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(limits.connection_idle_timeout_s)))
    if limits.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", _ms(limits.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(limits.connection_age_grace_s)),
        ]
    return options


def picker_options(config: GatewayConfig, shared: bool = False) -> list[tuple[str, int]]:
    """The picker port's: the main port's, with messages bounded by what the picker reads
    of a call: a body of `picker.max_body_bytes` and the headers around it (a longer body
    is the relay's: Envoy must buffer no more, see `gateway envoy-config`)."""
    receive = config.picker.max_body_bytes + PICKER_ENVELOPE_BYTES
    return [
        (key, receive if key == "grpc.max_receive_message_length" else value)
        for key, value in server_options(config, shared)
    ]


def _ms(seconds: float) -> int:
    return round(seconds * 1000)
