"""SGLang's scheduler protocol (`sglang.grpc.scheduler.SglangScheduler`)."""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from gateway.engines.base import EngineAdapter, GenerateInfo, RpcKind
from gateway.roles import Runtime


class SglangAdapter(EngineAdapter):
    runtime = Runtime.SGLANG
    service = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
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
        "LoadLoRAAdapter": RpcKind.FAN_OUT,
        "UnloadLoRAAdapter": RpcKind.FAN_OUT,
        "ListLoadedLoRAAdapters": RpcKind.FAN_OUT,
    }

    def generate_info(self, raw: bytes) -> GenerateInfo:
        request = pb.GenerateRequest.FromString(raw)
        mm = request.mm_inputs
        multimodal = request.HasField("mm_inputs") and bool(
            mm.image_urls
            or mm.video_urls
            or mm.audio_urls
            or mm.image_data
            or mm.video_data
            or mm.audio_data
            or mm.HasField("pixel_values")
        )
        return GenerateInfo(
            request_id=request.request_id,
            n=max(1, request.sampling_params.n),
            multimodal=multimodal,
        )

    def abort_ids(self, raw: bytes) -> list[str]:
        return [pb.AbortRequest.FromString(raw).request_id]

    def abort_request(self, request_ids: Sequence[str], raw: bytes) -> bytes:
        return raw  # one id per Abort: the client's own request goes on unchanged

    def abort_reply(self, found: bool, message: str) -> bytes:
        return bytes(pb.AbortResponse(success=found, message=message).SerializeToString())
