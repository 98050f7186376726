"""Worker channels: raised message limits, keepalive, no built-in retries (the gateway
retries itself)."""

from __future__ import annotations

import grpc
from grpc import aio

from gateway.config import UpstreamConfig

WORKER_METADATA_BYTES = 16 * 1024  # grpc's default hard limit on a received header block


def open_channel(
    address: str,
    max_message_bytes: int,
    upstream: UpstreamConfig,
    credentials: grpc.ChannelCredentials | None = None,
) -> aio.Channel:
    """A channel to one worker; TLS with `credentials` (a `grpcs://` worker)."""
    options: list[tuple[str, int]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        # Backpressure: while the gateway's client does not read, the worker may send one
        # stream window ahead and no more. With BDP probing on (grpc's default) the window
        # grows to max(4 MiB, 2 x BDP) per stream, which the gateway would hold in memory
        # for a client that stopped reading; a fixed window bounds it and pauses the worker.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", upstream.stream_window_bytes),
        # A worker's header block (headers, trailers) of up to grpc's own hard limit is
        # taken, always (grpc's soft limit refuses a block over 8 KiB at random), and cut
        # to what the client may get as it is relayed (gateway/proxy/metadata.py).
        ("grpc.max_metadata_size", WORKER_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", WORKER_METADATA_BYTES),
        # Reconnect fast after a worker restart: availability follows the channel.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if upstream.keepalive_time_s > 0:
        options += [
            ("grpc.keepalive_time_ms", round(upstream.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(upstream.keepalive_timeout_s * 1000)),
            # grpc waits this long for any ping's answer (default: a minute), whatever
            # the keepalive timeout says.
            ("grpc.http2.ping_timeout_ms", round(upstream.keepalive_timeout_s * 1000)),
            # Ping while a call waits for its first token too: that is when a frozen
            # worker sends nothing.
            ("grpc.http2.max_pings_without_data", 0),
        ]
    if credentials is not None:
        return aio.secure_channel(address, credentials, options=options)
    return aio.insecure_channel(address, options=options)
