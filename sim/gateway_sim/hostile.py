"""An SGLang worker that sends too much or sends garbage, in the test's own event loop:
a Generate stream with an answer that does not decode among its chunks, an adapter list
of any length, LoRA loads that never answer. The simulator is an honest engine; this is
the worker the gateway must not trust (tests and scripts/attacks share it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
GARBAGE = b"\xff\xff\xff"  # no protobuf message starts with field 0 of wire type 7


def stretch(request_id: str) -> int:
    """Which stretch of a migrated stream a request is: 0 the client's, k its `~k`."""
    _, sep, k = request_id.rpartition("~")
    return int(k) if sep and k.isdigit() else 0


@dataclass
class Hostile:
    """What the worker does and what it saw. A Generate answers one chunk per token (id
    100 + its position after a one-token prompt, so a continuation goes on where the
    stream stopped) up to its max_new_tokens, then Complete; by stretch (`stretch`), its
    `garbage_at`th answer is GARBAGE instead, and it fails UNAVAILABLE after `fail_at`
    answers. `per_chunk` tokens a chunk; `hold`: the stream held open after its last
    chunk (no Complete) until the client leaves. `adapters`: how many
    ListLoadedLoRAAdapters reports; `hold_loads`: loads never answer."""

    garbage_at: dict[int, int] = field(default_factory=dict)
    fail_at: dict[int, int] = field(default_factory=dict)
    per_chunk: int = 1
    hold: bool = False
    adapters: int = 0
    hold_loads: bool = False  # LoadLoRAAdapter never answers
    port: int = 0
    loads: list[str] = field(default_factory=list)  # lora_ids asked to load
    lists: int = 0  # ListLoadedLoRAAdapters answered
    held: int = 0  # Generate streams sent to their end and held open now

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, model: str = "m") -> str:
        return f"grpc://{self.address}?model={model}&runtime=sglang"

    def answers(self, request: Any) -> list[bytes]:
        """A Generate's answers, serialized, before `garbage_at` and `fail_at`."""
        start = len(request.tokenized.input_ids) - 1
        count = request.sampling_params.max_new_tokens
        step = self.per_chunk
        out = [
            pb.GenerateResponse(
                request_id=request.request_id,
                chunk=pb.GenerateStreamChunk(
                    token_ids=range(100 + start + i, 100 + start + min(i + step, count)),
                    prompt_tokens=start + 1,
                    completion_tokens=min(i + step, count),
                ),
            ).SerializeToString()
            for i in range(0, count, step)
        ]
        complete = pb.GenerateComplete(
            output_ids=[100 + start + count - 1],
            finish_reason="length",
            prompt_tokens=start + 1,
            completion_tokens=count,
        )
        out.append(
            pb.GenerateResponse(
                request_id=request.request_id, complete=complete
            ).SerializeToString()
        )
        return out

    async def _generate(self, raw: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        request = pb.GenerateRequest.FromString(raw)
        k = stretch(request.request_id)
        garbage, fail = self.garbage_at.get(k), self.fail_at.get(k)
        answers = self.answers(request)
        if self.hold:
            answers.pop()  # no Complete
        for at, answer in enumerate(answers):
            if at == fail:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "hostile worker failed")
            yield GARBAGE if at == garbage else answer
        if self.hold:
            self.held += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.held -= 1

    async def _list(self, request: bytes, context: aio.ServicerContext) -> bytes:
        self.lists += 1
        adapters = [pb.LoadedLoRAAdapter(lora_id=f"a{i}") for i in range(self.adapters)]
        return bytes(
            pb.ListLoadedLoRAAdaptersResponse(loaded_adapters=adapters).SerializeToString()
        )

    async def _load(self, request: bytes, context: aio.ServicerContext) -> bytes:
        self.loads.append(pb.LoadLoRAAdapterRequest.FromString(request).lora_id)
        if self.hold_loads:
            await asyncio.Event().wait()
        return bytes(pb.LoadLoRAAdapterResponse(success=True).SerializeToString())


@contextlib.asynccontextmanager
async def hostile(worker: Hostile) -> AsyncIterator[Hostile]:
    """The worker served on an ephemeral port until the block ends."""
    server = aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(worker._generate),
        "ListLoadedLoRAAdapters": grpc.unary_unary_rpc_method_handler(worker._list),
        "LoadLoRAAdapter": grpc.unary_unary_rpc_method_handler(worker._load),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    checks = health.aio.HealthServicer()
    await checks.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    worker.port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield worker
    finally:
        await server.stop(None)
