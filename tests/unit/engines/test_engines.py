"""Engine adapters: what the gateway reads from requests and how it merges fan-out replies."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from gateway.core.roles import Runtime
from gateway.engines import RpcKind, engine_adapters

adapters = engine_adapters()
SGLANG, VLLM = adapters[Runtime.SGLANG], adapters[Runtime.VLLM]


SHARED_KINDS = {
    "Generate": RpcKind.GENERATE,
    "Embed": RpcKind.EMBED,
    "HealthCheck": RpcKind.HEALTH_CHECK,
    "Abort": RpcKind.ABORT,
    "GetModelInfo": RpcKind.FORWARD_ONE,
    "GetServerInfo": RpcKind.FORWARD_ONE,
    "GetTokenizer": RpcKind.FORWARD_ONE,
    "SubscribeKvEvents": RpcKind.FORWARD_ONE,
    "GetLoads": RpcKind.FAN_OUT,
    "FlushCache": RpcKind.FAN_OUT,
    "StartProfile": RpcKind.FAN_OUT,
    "StopProfile": RpcKind.FAN_OUT,
}
SGLANG_ONLY = {
    "LoadLoRAAdapter": RpcKind.FAN_OUT,
    "UnloadLoRAAdapter": RpcKind.FAN_OUT,
    "ListLoadedLoRAAdapters": RpcKind.FAN_OUT,
}


def test_every_rpc_of_both_services_has_its_kind() -> None:
    """Written out by hand: a method the published protos add, or one an adapter serves
    under the wrong kind, fails here (the tables are built from the descriptors)."""
    assert {n: s.kind for n, s in SGLANG.rpcs.items()} == SHARED_KINDS | SGLANG_ONLY
    assert {n: s.kind for n, s in VLLM.rpcs.items()} == SHARED_KINDS
    assert set(SGLANG.rpcs) == set(
        sgl.DESCRIPTOR.services_by_name["SglangScheduler"].methods_by_name
    )
    assert set(VLLM.rpcs) == set(vllm.DESCRIPTOR.services_by_name["VllmEngine"].methods_by_name)
    assert SGLANG.rpcs["Generate"].kind is RpcKind.GENERATE
    assert SGLANG.rpcs["Generate"].server_streaming
    assert SGLANG.rpcs["GetTokenizer"].server_streaming
    assert VLLM.rpcs["GetLoads"].kind is RpcKind.FAN_OUT
    assert VLLM.rpcs["Abort"].path == "/vllm.grpc.engine.VllmEngine/Abort"


def test_generate_info_reads_id_n_and_multimodal() -> None:
    plain = sgl.GenerateRequest(request_id="a", sampling_params=sgl.SamplingParams(n=3))
    info = SGLANG.generate_info(plain.SerializeToString())
    assert (info.request_id, info.n, info.multimodal) == ("a", 3, False)
    images = sgl.GenerateRequest(request_id="b", mm_inputs=sgl.MultimodalInputs(image_urls=["u"]))
    assert SGLANG.generate_info(images.SerializeToString()).multimodal
    v = vllm.GenerateRequest(
        request_id="c", media_refs=vllm.MediaRefs(items=[vllm.MediaRef(url="u")])
    )
    assert VLLM.generate_info(v.SerializeToString()).multimodal
    assert VLLM.generate_info(vllm.GenerateRequest(request_id="d").SerializeToString()).n == 1


def test_garbage_does_not_decode() -> None:
    with pytest.raises(DecodeError):
        SGLANG.generate_info(b"\xff\xff\xff")


def test_get_loads_merge_keeps_one_entry_per_worker_and_rank() -> None:
    a = sgl.GetLoadsResponse(
        version="v",
        dp_rank_count=2,
        loads=[sgl.SchedulerLoad(dp_rank=0), sgl.SchedulerLoad(dp_rank=1)],
    )
    b = sgl.GetLoadsResponse(
        dp_rank_count=1, loads=[sgl.SchedulerLoad(dp_rank=0, num_running_reqs=4)]
    )
    merged = sgl.GetLoadsResponse.FromString(
        SGLANG.merge("GetLoads", [a.SerializeToString(), b.SerializeToString()])
    )
    assert merged.dp_rank_count == 3
    assert [x.num_running_reqs for x in merged.loads] == [0, 0, 4]
    assert merged.version == "v"


def test_outcome_merge_succeeds_only_if_every_worker_did() -> None:
    ok = common.FlushCacheResponse(success=True, message="a flushed").SerializeToString()
    bad = common.FlushCacheResponse(success=False, message="b busy").SerializeToString()
    merged = common.FlushCacheResponse.FromString(SGLANG.merge("FlushCache", [ok, bad]))
    assert (merged.success, merged.message) == (False, "a flushed; b busy")


def test_lora_merge_keeps_adapters_every_worker_has() -> None:
    a = sgl.LoadLoRAAdapterResponse(success=True, loaded_lora_ids=["x", "y"]).SerializeToString()
    b = sgl.LoadLoRAAdapterResponse(success=True, loaded_lora_ids=["y", "z"]).SerializeToString()
    merged = sgl.LoadLoRAAdapterResponse.FromString(SGLANG.merge("LoadLoRAAdapter", [a, b]))
    assert list(merged.loaded_lora_ids) == ["y"]


def test_abort_replies() -> None:
    assert sgl.AbortResponse.FromString(SGLANG.abort_reply(False, "gone")) == sgl.AbortResponse(
        success=False, message="gone"
    )
    assert VLLM.abort_ids(vllm.AbortRequest(request_ids=["a", "b"]).SerializeToString()) == [
        "a",
        "b",
    ]
    forwarded = vllm.AbortRequest.FromString(VLLM.abort_request(["b"], b""))
    assert list(forwarded.request_ids) == ["b"]


def test_model_facts_name_falls_back_to_model_path_and_read_the_vocabulary() -> None:
    info = sgl.GetModelInfoResponse(model_path="/models/llama").SerializeToString()
    assert SGLANG.model_facts(info).name == "/models/llama"
    assert SGLANG.model_facts(info).vocab_size is None  # not said
    named = vllm.GetModelInfoResponse(served_model_name="q", model_path="/p", vocab_size=512)
    facts = VLLM.model_facts(named.SerializeToString())
    assert (facts.name, facts.vocab_size) == ("q", 512)


def test_the_running_window_is_read_from_server_info_and_bounded() -> None:
    info = vllm.GetServerInfoResponse(max_num_seqs=4, data_parallel_size=2, kv_role="kv_consumer")
    assert VLLM.server_facts(info.SerializeToString()).window == 8  # per rank, times ranks
    assert VLLM.server_facts(vllm.GetServerInfoResponse().SerializeToString()).window is None
    args = sgl.GetServerInfoResponse()
    args.server_args.update({"disaggregation_mode": "decode", "max_running_requests": 4})
    assert SGLANG.server_facts(args.SerializeToString()).window == 4
    args.server_args.update({"max_running_requests": 1e12})  # not a plausible count
    assert SGLANG.server_facts(args.SerializeToString()).window is None
