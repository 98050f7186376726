"""vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from gateway.core.roles import Role, Runtime
from gateway.engines.base import EngineAdapter, GenerateInfo, ServerFacts, block_size_ok, window_ok
from gateway.engines.handoff import Handoff, PlacedPair
from gateway.engines.rpcs import RpcKind
from gateway.engines.tokens import TokenIds
from gateway.engines.usage import Counting

PREFILL_KV_PARAMS = json.dumps({"do_remote_decode": True, "do_remote_prefill": False})


class KvParamsHandoff(Handoff):
    """vLLM PD (NIXL style), sequential: the prefill computes one token and keeps the KV
    for a remote decode; the `kv_transfer_params` of its Complete go into the decode's
    request, which fetches the KV from there."""

    async def run(self, pair: PlacedPair) -> None:
        prefill = pair.prefill(prefill_request(pair.raw), background=False)
        answered = await prefill.drain()
        params = kv_transfer_params(answered)
        if params is None:
            raise pair.prefill_failed(
                "missing_kv_params",
                "returned no kv_transfer_params; the decode cannot fetch the KV cache",
            )
        # The decode's answers count the prompt as computed remotely, not cached: the
        # prefill's own figure is the call's.
        pair.prompt_cached(prefill_cached_tokens(answered))
        patch = pb.GenerateRequest(kv_transfer_params_json=params)
        await pair.decode(pair.raw + bytes(patch.SerializeToString()))


def prefill_request(raw: bytes) -> bytes:
    """vLLM PD's first step: one token, not streamed, asking for remote decode."""
    request = pb.GenerateRequest.FromString(raw)
    request.sampling_params.max_tokens = 1
    request.sampling_params.n = 1
    request.stream = False
    request.kv_transfer_params_json = PREFILL_KV_PARAMS
    return bytes(request.SerializeToString())


def kv_transfer_params(prefill_messages: list[bytes]) -> str | None:
    """The handoff the prefill's Complete returned, if it returned one."""
    for raw in reversed(prefill_messages):
        response = pb.GenerateResponse.FromString(raw)
        if response.HasField("complete") and response.complete.kv_transfer_params_json:
            return str(response.complete.kv_transfer_params_json)
    return None


def prefill_cached_tokens(prefill_messages: list[bytes]) -> int:
    """The prompt tokens the prefill found in its cache, as its Complete says."""
    for raw in reversed(prefill_messages):
        response = pb.GenerateResponse.FromString(raw)
        if response.HasField("complete"):
            return int(response.complete.cached_tokens)
    return 0


def _unresumable(request: Any, multimodal: bool) -> str:
    """Why a continuation could not resume it: a grammar's state is the engine's, and a
    text prompt has no token ids to append to."""
    if request.sampling_params.WhichOneof("constraint"):
        return "constrained"
    if request.sampling_params.HasField("prompt_logprobs"):
        return "prompt_logprobs"
    if multimodal:
        return "multimodal"
    if request.WhichOneof("input") != "tokenized":
        return "text_prompt"
    return ""


class VllmAdapter(EngineAdapter):
    runtime = Runtime.VLLM
    handoff = KvParamsHandoff()
    service = pb.DESCRIPTOR.services_by_name["VllmEngine"]
    max_tokens_field = "max_tokens"
    min_tokens_field = "min_tokens"
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

    def _generate_info(self, request: Any, tokens: TokenIds) -> GenerateInfo:
        multimodal = (
            request.HasField("mm_inputs")
            or bool(request.extra_mm_inputs)
            or bool(request.media_refs.items)
        )
        return GenerateInfo(
            request_id=request.request_id,
            n=max(1, request.sampling_params.n),
            multimodal=multimodal,
            return_logprob=request.sampling_params.HasField("prompt_logprobs"),
            tokens=tokens,
            max_new_tokens=(
                request.sampling_params.max_tokens
                if request.sampling_params.HasField("max_tokens")
                else None
            ),
            stream=request.stream,
            min_new_tokens=request.sampling_params.min_tokens,
            unresumable=_unresumable(request, multimodal),
            text_prompt=request.WhichOneof("input") == "text",
        )

    def counting(self, stream: bool) -> Counting:
        """vLLM streams in delta mode: a chunk counts its own tokens, and the Complete
        after a choice's last chunk repeats that chunk; unstreamed, the Complete has all."""
        return Counting.DELTAS if stream else Counting.TOTALS

    def server_facts(self, server_info: bytes) -> ServerFacts:
        info = pb.GetServerInfoResponse.FromString(server_info)
        role = {
            "kv_producer": Role.PREFILL,
            "kv_consumer": Role.DECODE,
            "kv_both": Role.REGULAR,
            "": Role.REGULAR,
        }.get(info.kv_role)
        # What a prefill and a decode must agree on for the KV handoff (vLLM's NIXL
        # compatibility factors); empty when no connector is configured.
        agree = {
            "protocol": info.pairing_protocol,
            "kv_cache_dtype": info.kv_cache_dtype,
            "block_size": str(info.block_size or ""),
        }
        pairing = " ".join([info.kv_connector, *(f"{k}={v}" for k, v in agree.items() if v)])
        window = info.max_num_seqs * max(1, info.data_parallel_size)  # max_num_seqs: per rank
        return ServerFacts(
            role=role,
            pairing=pairing if info.kv_connector else "",
            block_size=info.block_size if block_size_ok(info.block_size) else None,
            window=window if window_ok(window) else None,
        )

    def abort_ids(self, raw: bytes) -> list[str]:
        return list(pb.AbortRequest.FromString(raw).request_ids)

    def abort_request(self, request_ids: Sequence[str], raw: bytes) -> bytes:
        return bytes(pb.AbortRequest(request_ids=list(request_ids)).SerializeToString())

    def abort_reply(self, found: bool, message: str) -> bytes:
        return bytes(pb.AbortResponse().SerializeToString())  # vLLM's answer carries no fields
