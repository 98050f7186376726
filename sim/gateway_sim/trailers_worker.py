"""An SGLang worker whose answers carry the headers and trailers a request asks for:
`python -m gateway_sim.trailers_worker`, prints `READY 127.0.0.1:PORT`. For the tests of
what the gateway relays of a worker's metadata (tests/e2e/test_relayed_metadata.py) and
the trailers attack (scripts/attacks/scenarios.py).

A Generate streams one chunk per token asked for (`max_new_tokens`, at most MAX_TOKENS),
then a Complete, and ends OK. Request metadata says what goes with the answer:

    x-header-bytes: N     response headers `x-pad-NNN` of 256 bytes each (key + value +
                          32, as HTTP/2 counts them) up to about N bytes
    x-trailer-bytes: N    the same, as trailers
    x-trailer-extra: k=v,...  more trailers (a `-bin` key's value as bytes)
    x-fail-code: NAME     end with this status instead of OK (after the messages)
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
ENTRY_BYTES = 256  # each padding entry, as HTTP/2 counts it
MAX_BYTES = 64 * 1024
MAX_TOKENS = 64

Metadata = tuple[tuple[str, str | bytes], ...]


def padding(total: int) -> Metadata:
    """Entries of ENTRY_BYTES each, up to about `total` bytes (bounded)."""
    count = math.ceil(min(total, MAX_BYTES) / ENTRY_BYTES)
    return tuple(
        (key, "v" * (ENTRY_BYTES - 32 - len(key)))
        for key in (f"x-pad-{i:03d}" for i in range(count))
    )


def extra(text: str) -> Metadata:
    """`k=v,k2=v2` as entries; a `-bin` key's value as its UTF-8 bytes."""
    entries: list[tuple[str, str | bytes]] = []
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        entries.append((key, value.encode() if key.endswith("-bin") else value))
    return tuple(entries)


def asked(metadata: Sequence[tuple[str, str | bytes]]) -> dict[str, str]:
    return {k: v for k, v in metadata if isinstance(v, str)}


async def generate(raw: bytes, context: aio.ServicerContext) -> Any:
    request = sgl.GenerateRequest.FromString(raw)
    wants = asked(context.invocation_metadata() or ())
    headers = padding(int(wants.get("x-header-bytes", "0")))
    if headers:
        await context.send_initial_metadata(headers)
    prompt = len(request.tokenized.input_ids)
    tokens = min(request.sampling_params.max_new_tokens or 4, MAX_TOKENS)
    for index in range(tokens):
        chunk = sgl.GenerateStreamChunk(
            token_ids=[index + 10], prompt_tokens=prompt, completion_tokens=index + 1
        )
        yield sgl.GenerateResponse(request_id=request.request_id, chunk=chunk).SerializeToString()
    complete = sgl.GenerateComplete(
        output_ids=[i + 10 for i in range(tokens)],
        finish_reason="length",
        prompt_tokens=prompt,
        completion_tokens=tokens,
    )
    yield sgl.GenerateResponse(request_id=request.request_id, complete=complete).SerializeToString()
    trailers = padding(int(wants.get("x-trailer-bytes", "0"))) + extra(
        wants.get("x-trailer-extra", "")
    )
    fail = wants.get("x-fail-code")
    if fail:
        await context.abort(grpc.StatusCode[fail], "failed as asked", trailers)
    context.set_trailing_metadata(trailers)


async def main() -> None:
    server = aio.server()
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(generate)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    checks = health.aio.HealthServicer()
    await checks.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
