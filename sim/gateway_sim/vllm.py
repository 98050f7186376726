"""The simulated vLLM engine: ``vllm.grpc.engine.VllmEngine``."""

from __future__ import annotations

from typing import Any

from grpc.aio import ServicerContext
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim.engine import MAX_RUNNING_REQUESTS, Codec
from gateway_sim.shared import SharedRpcs

SERVICE_NAME: str = vllm_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


_CODEC = Codec(vllm_pb2, with_request_id=False)


def input_ids_of(request: Any) -> Any:
    """The prompt's token ids; text prompts have no tokenizer here: one "token" per
    UTF-8 byte."""
    if request.WhichOneof("input") == "text":
        return list(request.text.encode())
    return request.tokenized.input_ids


class VllmServicer(SharedRpcs, vllm_grpc.VllmEngineServicer):  # type: ignore[misc]
    """vLLM-only RPCs; the rest come from SharedRpcs or answer UNIMPLEMENTED."""

    _pb = vllm_pb2

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        params = request.sampling_params
        await self._engine.generate(
            context,
            _CODEC,
            request.request_id,
            input_ids_of(request),
            params.n,
            params.max_tokens if params.HasField("max_tokens") else None,
            request.stream,
            self._engine.rank_of(request),
        )

    async def Abort(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        self._engine.active.abort(request.request_ids)
        return vllm_pb2.AbortResponse()

    async def GetServerInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return vllm_pb2.GetServerInfoResponse(
            active_requests=len(self._engine.active),
            uptime_seconds=self._engine.uptime(),
            server_type="vllm-grpc",
            kv_role="",
            data_parallel_size=self._engine.config.dp_ranks,
            max_num_seqs=MAX_RUNNING_REQUESTS,
        )
