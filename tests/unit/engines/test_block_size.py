"""Without followed KV events the index guesses from the gateway's placements; the guess
uses the block size the worker reports in GetServerInfo (vLLM's CPU backend: 128), not
`kv.block_size`, and a reported size no real engine has is ignored."""

from __future__ import annotations

from google.protobuf import struct_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from gateway.config import KvConfig, WorkerSpec
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix
from gateway.placement.policies import Hints
from gateway.placement.policies.cache_aware import CacheAware
from tests.support.factories import make_worker

ADAPTERS = engine_adapters()


def vllm_facts(block_size: int) -> int | None:
    info = vllm.GetServerInfoResponse(block_size=block_size, kv_cache_dtype="auto")
    return ADAPTERS[Runtime.VLLM].server_facts(info.SerializeToString()).block_size


def test_the_block_size_a_worker_reports_is_read_and_range_checked() -> None:
    assert vllm_facts(128) == 128
    assert vllm_facts(0) is None
    assert vllm_facts(1 << 20) is None
    args = struct_pb2.Struct()
    args.update({"page_size": 64})
    info = sgl.GetServerInfoResponse(server_args=args)
    assert ADAPTERS[Runtime.SGLANG].server_facts(info.SerializeToString()).block_size == 64


def test_a_guess_is_made_in_the_workers_own_block_size() -> None:
    index = KvIndex(block_size=16)
    policy = CacheAware(index, KvConfig(), stale_after_s=3)
    worker = make_worker(WorkerSpec("a", 1, "m", Runtime.VLLM), runtime=Runtime.VLLM)
    worker.block_size = 128
    prompt = Prefix(list(range(300)))  # two blocks of 128 (and 18 of 16)
    policy.choose([worker], Hints(prefix=prompt))
    assert index._slots[("a:1", 0)].block_size == 128
    again = Prefix(list(range(300)))
    assert index.matched_tokens(again, ["a:1"], 0.0) == {("a:1", 0): 256}
