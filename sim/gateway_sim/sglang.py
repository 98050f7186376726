"""The simulated SGLang scheduler: ``sglang.grpc.scheduler.SglangScheduler``."""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2, timestamp_pb2
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway_sim.engine import Codec, SimEngine
from gateway_sim.shared import SIM_VERSION, SharedRpcs

SERVICE_NAME: str = sgl_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name


_CODEC = Codec(sgl_pb2, with_request_id=True)


class SglangServicer(SharedRpcs, sgl_grpc.SglangSchedulerServicer):  # type: ignore[misc]
    """SGLang-only RPCs; the rest come from SharedRpcs or answer UNIMPLEMENTED."""

    _pb = sgl_pb2

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        self._loras: dict[str, Any] = {}

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        params = request.sampling_params
        await self._engine.generate(
            context,
            _CODEC,
            request.request_id,
            request.tokenized.input_ids,
            params.n,
            params.max_new_tokens if params.HasField("max_new_tokens") else None,
            request.stream,
            self._engine.rank_of(request),
            request.lora_id,
        )

    async def Abort(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        if self._engine.active.abort((request.request_id,)):
            return sgl_pb2.AbortResponse(success=True, message="")
        return sgl_pb2.AbortResponse(success=False, message="request not found")

    async def GetServerInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        config = self._engine.config
        server_args = struct_pb2.Struct()
        server_args.update(
            {
                "model_path": config.model_path,
                "served_model_name": config.model,
                "tokenizer_path": config.model_path,
                "disaggregation_mode": "null",
                "disaggregation_bootstrap_port": 8998,
                "tp_size": 1,
                "dp_size": config.dp_ranks,
            }
        )
        scheduler_info = struct_pb2.Struct()
        scheduler_info.update({"max_total_num_tokens": self._engine.kv_tokens})
        start_time = timestamp_pb2.Timestamp()
        start_time.FromSeconds(int(self._engine.started_at))
        return sgl_pb2.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=len(self._engine.active),
            uptime_seconds=self._engine.uptime(),
            sglang_version=SIM_VERSION,
            server_type="grpc",
            start_time=start_time,
            max_total_num_tokens=self._engine.kv_tokens,
        )

    async def GetLoads(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        response = self._loads(request)
        dp_ranks = self._engine.config.dp_ranks
        running = len(self._engine.active)
        mean_usage = self._engine.token_usage(running) / dp_ranks
        response.aggregate.CopyFrom(
            sgl_pb2.AggregateMetrics(
                total_running_reqs=running,
                total_waiting_reqs=0,
                total_reqs=running,
                avg_token_usage=mean_usage,
                avg_utilization=mean_usage,
            )
        )
        return response

    # ------------------------------------------------------------ LoRA adapters

    def _lora_ids(self) -> list[str]:
        return sorted(self._loras)

    async def LoadLoRAAdapter(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        if not request.lora_id or not request.lora_name:
            return sgl_pb2.LoadLoRAAdapterResponse(
                success=False,
                message="lora_name and lora_id are required",
                loaded_lora_ids=self._lora_ids(),
            )
        self._loras[request.lora_id] = sgl_pb2.LoadedLoRAAdapter(
            lora_id=request.lora_id,
            lora_name=request.lora_name,
            lora_path=request.lora_path,
            pinned=request.pinned,
        )
        return sgl_pb2.LoadLoRAAdapterResponse(success=True, loaded_lora_ids=self._lora_ids())

    async def UnloadLoRAAdapter(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        found = [
            lora_id
            for lora_id, adapter in self._loras.items()
            if (request.lora_id and lora_id == request.lora_id)
            or (not request.lora_id and adapter.lora_name == request.lora_name)
        ]
        for lora_id in found:
            del self._loras[lora_id]
        return sgl_pb2.UnloadLoRAAdapterResponse(
            success=bool(found),
            message="" if found else "adapter not found",
            loaded_lora_ids=self._lora_ids(),
        )

    async def ListLoadedLoRAAdapters(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        return sgl_pb2.ListLoadedLoRAAdaptersResponse(
            loaded_adapters=[self._loras[lora_id] for lora_id in self._lora_ids()]
        )
