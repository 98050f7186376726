"""vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`)."""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from gateway.engines.base import EngineAdapter, GenerateInfo, RpcKind
from gateway.roles import Runtime


class VllmAdapter(EngineAdapter):
    runtime = Runtime.VLLM
    service = pb.DESCRIPTOR.services_by_name["VllmEngine"]
    kinds = {
        "Generate": RpcKind.GENERATE,
        "Embed": RpcKind.EMBED,
        "Abort": RpcKind.ABORT,
        "HealthCheck": RpcKind.HEALTH_CHECK,
        "GetModelInfo": RpcKind.FORWARD_ONE,
        "GetServerInfo": RpcKind.FORWARD_ONE,
        "GetTokenizer": RpcKind.FORWARD_ONE,
        "SubscribeKvEvents": RpcKind.FORWARD_ONE,
        "GetLoads": RpcKind.FAN_OUT,
        "FlushCache": RpcKind.FAN_OUT,
        "StartProfile": RpcKind.FAN_OUT,
        "StopProfile": RpcKind.FAN_OUT,
    }

    def generate_info(self, raw: bytes) -> GenerateInfo:
        request = pb.GenerateRequest.FromString(raw)
        multimodal = (
            request.HasField("mm_inputs")
            or bool(request.extra_mm_inputs)
            or bool(request.media_refs.items)
        )
        return GenerateInfo(
            request_id=request.request_id,
            n=max(1, request.sampling_params.n),
            multimodal=multimodal,
        )

    def abort_ids(self, raw: bytes) -> list[str]:
        return list(pb.AbortRequest.FromString(raw).request_ids)

    def abort_request(self, request_ids: Sequence[str], raw: bytes) -> bytes:
        return bytes(pb.AbortRequest(request_ids=list(request_ids)).SerializeToString())

    def abort_reply(self, found: bool, message: str) -> bytes:
        return bytes(pb.AbortResponse().SerializeToString())  # vLLM's answer carries no fields
