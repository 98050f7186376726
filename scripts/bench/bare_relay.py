#!/usr/bin/env python3
"""A bare grpc.aio raw-bytes relay with no routing: the per-core floor the gateway is
measured against (scripts/bench/bench.py). Same transport options as the gateway's main port and
worker channels, one upstream, and only what any transparent relay does: the request's
metadata and deadline up, the worker's headers, messages and trailers down.

    python scripts/bench/bare_relay.py --upstream 127.0.0.1:30000   # prints READY 127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.app.run import on_loop
from gateway.app.transport import server_options
from gateway.config import build_config
from gateway.upstream.channels import open_channel


def relaying(method: Callable[..., Any]) -> Callable[[bytes, Any], Awaitable[None]]:
    """The handler of one method: `method(request, metadata=, timeout=)` starts the
    upstream call (a channel's unary_stream callable). scripts/bench/bench_call.py runs it too."""

    async def stream(request: bytes, context: aio.ServicerContext) -> None:
        call = method(
            request, metadata=context.invocation_metadata(), timeout=context.time_remaining()
        )
        # What any transparent relay does: the worker's headers as soon as they come,
        # its messages, its trailers.
        headers = await call.initial_metadata()
        if headers:
            await context.send_initial_metadata(headers)
        read, write = call.read, context.write
        message = await read()
        while message is not aio.EOF:
            await write(message)
            message = await read()
        context.set_trailing_metadata(await call.trailing_metadata())

    return stream


async def relay(upstream: str) -> None:
    config = build_config()
    channel = open_channel(upstream, config.max_message_bytes, config.upstream)

    def streaming(path: str) -> Any:
        stream = relaying(channel.unary_stream(path))
        return grpc.unary_stream_rpc_method_handler(stream)

    class Everything(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: Any) -> Any:
            return streaming(details.method)

    server = aio.server(options=server_options(config))
    server.add_generic_rpc_handlers((Everything(),))
    await serve_until_terminated(server)


async def serve_until_terminated(server: aio.Server) -> None:
    """Serve on a free loopback port, announced as `READY 127.0.0.1:PORT` (what
    scripts/bench/bench.py waits for), until SIGTERM. scripts/bench/floor_picker.py
    serves so too."""
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the worker")
    args = parser.parse_args()
    on_loop(relay(args.upstream))


if __name__ == "__main__":
    main()
