"""SGLang's scheduler protocol (`sglang.grpc.scheduler.SglangScheduler`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from gateway.core.roles import Role, Runtime
from gateway.engines.base import EngineAdapter, GenerateInfo, ServerFacts, block_size_ok, window_ok
from gateway.engines.handoff import Handoff, PlacedPair
from gateway.engines.rpcs import RpcKind
from gateway.engines.tokens import TokenIds
from gateway.engines.usage import Counting

DEFAULT_BOOTSTRAP_PORT = 8998


class BootstrapHandoff(Handoff):
    """SGLang PD: the same request, naming the prefill's bootstrap host, port and a fresh
    room, goes to prefill and decode at once; they meet on the prefill's bootstrap port.
    The client gets the decode's stream; with `return_logprob`, the prompt logprobs only
    the prefill has go into the decode's first message."""

    async def run(self, pair: PlacedPair) -> None:
        port = pair.prefill_bootstrap_port or DEFAULT_BOOTSTRAP_PORT
        request = with_bootstrap(pair.raw, pair.prefill_host, port, pair.new_room())
        prefill = pair.prefill(request, background=True)

        async def with_prompt_logprobs(first: bytes) -> bytes:
            return with_input_logprobs(first, await prefill.drain())

        await pair.decode(request, with_prompt_logprobs if pair.return_logprob else None)


def with_bootstrap(raw: bytes, host: str, port: int, room: int) -> bytes:
    """The request both legs get: where the prefill's KV is handed over, and the room."""
    patch = pb.GenerateRequest(
        disaggregated_params=pb.DisaggregatedParams(
            bootstrap_host=host, bootstrap_port=port, bootstrap_room=room
        )
    )
    return raw + bytes(patch.SerializeToString())


def with_input_logprobs(decode_message: bytes, prefill_messages: list[bytes]) -> bytes:
    """The decode's first message, carrying the prompt logprobs only the prefill has."""
    found = None
    for raw in reversed(prefill_messages):
        response = pb.GenerateResponse.FromString(raw)
        part = getattr(response, response.WhichOneof("response") or "complete")
        if part.HasField("input_logprobs"):
            found = part.input_logprobs
            break
    if found is None:
        return decode_message
    response = pb.GenerateResponse.FromString(decode_message)
    part = getattr(response, response.WhichOneof("response") or "chunk")
    part.input_logprobs.CopyFrom(found)
    return bytes(response.SerializeToString())


def _unresumable(request: Any, multimodal: bool) -> str:
    """Why a continuation could not resume it: a grammar's state is the engine's; with
    `return_logprob` the prompt's logprobs come too unless `logprob_start_len` is -1."""
    if request.sampling_params.WhichOneof("constraint"):
        return "constrained"
    if request.return_logprob and request.logprob_start_len != -1:
        return "prompt_logprobs"
    if multimodal or not request.tokenized.input_ids:
        return "multimodal" if multimodal else "no_token_ids"
    return ""


class SglangAdapter(EngineAdapter):
    runtime = Runtime.SGLANG
    handoff = BootstrapHandoff()
    service = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
    max_tokens_field = "max_new_tokens"
    min_tokens_field = "min_new_tokens"
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

    def _generate_info(self, request: Any, tokens: TokenIds) -> GenerateInfo:
        multimodal, mm_items = False, ()
        if request.HasField("mm_inputs"):
            mm = request.mm_inputs
            mm_items = (*mm.image_urls, *mm.video_urls, *mm.audio_urls)
            multimodal = bool(
                mm_items or mm.image_data or mm.video_data or mm.audio_data
            ) or mm.HasField("pixel_values")
        return GenerateInfo(
            request_id=request.request_id,
            n=max(1, request.sampling_params.n),
            multimodal=multimodal,
            mm_items=mm_items,
            return_logprob=request.return_logprob,
            tokens=tokens,
            namespace=f"lora:{request.lora_id}" if request.lora_id else "",
            max_new_tokens=(
                request.sampling_params.max_new_tokens
                if request.sampling_params.HasField("max_new_tokens")
                else None
            ),
            stream=request.stream,
            min_new_tokens=request.sampling_params.min_new_tokens,
            unresumable=_unresumable(request, multimodal),
        )

    def response_id(self, message: bytes) -> str:
        return str(pb.GenerateResponse.FromString(message).request_id)

    def _set_response_id(self, response: Any, request_id: str) -> None:
        response.request_id = request_id

    def counting(self, stream: bool) -> Counting:
        """SGLang's chunks carry the choice's running totals, its Complete all of them."""
        return Counting.TOTALS

    def server_facts(self, server_info: bytes) -> ServerFacts:
        args = pb.GetServerInfoResponse.FromString(server_info).server_args
        fields = args.fields
        mode = fields["disaggregation_mode"].string_value if "disaggregation_mode" in fields else ""
        role = {"prefill": Role.PREFILL, "decode": Role.DECODE, "null": Role.REGULAR}.get(mode)
        port_value = fields.get("disaggregation_bootstrap_port")
        port = int(port_value.number_value) if port_value is not None else 0
        backend = fields.get("disaggregation_transfer_backend")
        page = fields.get("page_size")
        running = fields.get("max_running_requests")  # the servicer fills in the computed one
        window = running.number_value if running is not None else 0.0
        return ServerFacts(
            role=role,
            bootstrap_port=port or None,
            pairing=backend.string_value if backend is not None else "",
            block_size=(
                int(page.number_value)
                if page is not None and block_size_ok(page.number_value)
                else None
            ),
            window=int(window) if window_ok(window) else None,
        )

    def abort_ids(self, raw: bytes) -> list[str]:
        return [pb.AbortRequest.FromString(raw).request_id]

    def abort_request(self, request_ids: Sequence[str], raw: bytes) -> bytes:
        """SGLang's Abort names one id: the gateway sends one per upstream request."""
        (request_id,) = request_ids
        return raw + bytes(pb.AbortRequest(request_id=request_id).SerializeToString())

    def abort_reply(self, found: bool, message: str) -> bytes:
        return bytes(pb.AbortResponse(success=found, message=message).SerializeToString())
