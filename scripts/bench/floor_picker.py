#!/usr/bin/env python3
"""The cheapest grpc.aio endpoint picker: the floor the gateway's picker is measured
against (scripts/bench/bench.py --mode picker), as scripts/bench/bare_relay.py is the
relay's. Envoy's external processing service on a port with the gateway's picker-port
transport options and the gRPC health service (Envoy health-checks its picker),
answering every part of a call with the gateway's own "go on" bytes
(gateway/picker/wire.py) and the request's body with the one upstream named: no
decoding, no placement, no call followed.

    python scripts/bench/floor_picker.py --upstream 127.0.0.1:30000   # prints READY 127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bare_relay import serve_until_terminated

from gateway.app.run import on_loop
from gateway.app.transport import picker_options
from gateway.config import build_config
from gateway.config.picker import DESTINATION_HEADER
from gateway.picker import wire
from gateway.picker.service import SERVICE
from gateway.picker.v3 import external_processor_pb2 as ext_proc


def answers(upstream: str) -> dict[str, bytes]:
    """The answer to each part of a call, built once: the body's names `upstream` (in
    the header Envoy's original destination cluster reads, as picker_bootstrap sets it)."""
    return {**wire.GO_ON, "request_body": wire.destination(DESTINATION_HEADER, upstream)}


def processing(upstream: str) -> grpc.RpcMethodHandler:
    """`Process`: a read/write loop (a generator handler measured slower), one answer per
    part until Envoy closes the stream."""
    answer = answers(upstream)

    async def process(_requests: Any, stream: aio.ServicerContext) -> None:
        read, write = stream.read, stream.write
        request = await read()
        while request is not aio.EOF:
            await write(answer.get(request.WhichOneof("request") or "", b""))
            request = await read()

    return grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=ext_proc.ProcessingRequest.FromString,
        response_serializer=None,  # answers are bytes, as the gateway's picker sends them
    )


async def serve(upstream: str) -> None:
    server = aio.server(options=picker_options(build_config()))
    method = processing(upstream)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Process": method}),)
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # SERVING
    await serve_until_terminated(server)


def ip_port(value: str) -> str:
    """`IP:PORT` (Envoy's original destination cluster connects to it as named)."""
    host, _, port = value.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        if not 0 < int(port) < 65536:
            raise ValueError(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not IP:PORT: {value!r}") from None
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--upstream", required=True, type=ip_port, help="IP:PORT of the worker, named to Envoy"
    )
    args = parser.parse_args()
    on_loop(serve(args.upstream))


if __name__ == "__main__":
    main()
