"""The simulated EPD encoder: ``sglang.grpc.encoder.SglangEncoder`` (``--role encode``).

Encode takes ``--ttft-ms`` to "encode" the items, then pushes one part to the prefill
named in the request (``prefill_host:embedding_port[0]``, see ``embeddings``) and answers
with the embedding's shape. It fails:

- no ``mm_items``, ``part_idx`` not below ``num_parts``, no prefill address:
  INVALID_ARGUMENT;
- the prefill cannot be reached (refused, no answer in time): UNAVAILABLE;
- the prefill rejects the part (``num_parts`` disagrees with other parts): INTERNAL.

Each answer carries the header ``x-sim-encoded-items``: items this worker has encoded,
this call included, so a test can see where the router's hashing sent them.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import sglang_encoder_pb2 as enc_pb2
from smg_grpc_proto.generated import sglang_encoder_pb2_grpc as enc_grpc

from gateway_sim.disagg import reject
from gateway_sim.embeddings import PushFailed, push
from gateway_sim.engine import SimEngine

log = logging.getLogger("gateway_sim")

SERVICE_NAME: str = enc_pb2.DESCRIPTOR.services_by_name["SglangEncoder"].full_name
ENCODED_HEADER = "x-sim-encoded-items"
TOKENS_PER_ITEM = 16
EMBEDDING_DIM = 64
FLOAT_BYTES = 4
PUSH_TIMEOUT_S = 3.0


class EncoderServicer(enc_grpc.SglangEncoderServicer):  # type: ignore[misc]
    """Encode only; Send and SchedulerReceiveUrl (other transfer backends) answer
    UNIMPLEMENTED."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine
        self.encoded = 0

    async def Encode(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        items = list(request.mm_items)
        if not items:
            await reject(context, grpc.StatusCode.INVALID_ARGUMENT, "Encode needs mm_items")
        if not request.part_idx < request.num_parts:
            await reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"part_idx {request.part_idx} is not below num_parts {request.num_parts}",
            )
        if not request.prefill_host or not request.embedding_port:
            await reject(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "Encode needs prefill_host and embedding_port",
            )
        port = request.embedding_port[0]
        total = self.encoded + len(items)
        await self._engine.unary(context, request.req_id, ((ENCODED_HEADER, str(total)),))
        self.encoded += len(items)
        log.info(
            "%s: encoded %d items of %s part %d/%d (%d in all)",
            self._engine.name,
            len(items),
            request.req_id,
            request.part_idx,
            request.num_parts,
            self.encoded,
        )
        remaining = context.time_remaining()
        timeout_s = PUSH_TIMEOUT_S if remaining is None else min(PUSH_TIMEOUT_S, remaining)
        try:
            await push(
                request.prefill_host,
                port,
                request.req_id,
                request.part_idx,
                request.num_parts,
                items,
                self._engine.name,
                max(timeout_s, 0.0),
            )
        except PushFailed as exc:
            code = grpc.StatusCode.UNAVAILABLE if exc.unreachable else grpc.StatusCode.INTERNAL
            await reject(context, code, str(exc))
        length = len(items) * TOKENS_PER_ITEM
        return enc_pb2.EncodeResponse(
            embedding_size=length * EMBEDDING_DIM * FLOAT_BYTES,
            embedding_len=length,
            embedding_dim=EMBEDDING_DIM,
        )
