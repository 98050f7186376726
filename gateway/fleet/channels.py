"""Worker channels: raised message limits, no built-in retries (the gateway retries itself)."""

from __future__ import annotations

from grpc import aio


def open_channel(address: str, max_message_bytes: int) -> aio.Channel:
    return aio.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_retries", 0),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
            # Reconnect fast after a worker restart: availability follows the channel.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2_000),
        ],
    )
