"""SGLang's multimodal encoder protocol (`sglang.grpc.encoder.SglangEncoder`), the EPD leg."""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto.generated import sglang_encoder_pb2 as pb

from gateway.core.roles import Runtime

RUNTIME = Runtime.SGLANG  # the engine whose disaggregation the encode leg belongs to
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["SglangEncoder"].full_name
ENCODE_PATH = f"/{SERVICE_NAME}/Encode"


def encode_request(
    items: Sequence[str],
    request_id: str,
    num_parts: int,
    part_idx: int,
    prefill_host: str,
    embedding_port: int,
) -> bytes:
    """One part of a request's items, sent to one encode worker, naming the receiver."""
    return bytes(
        pb.EncodeRequest(
            mm_items=list(items),
            req_id=request_id,
            num_parts=num_parts,
            part_idx=part_idx,
            prefill_host=prefill_host,
            embedding_port=[embedding_port],
        ).SerializeToString()
    )
