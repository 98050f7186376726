"""A worker's LoRA adapters as its one writer keeps them: polls, the gateway's own loads
and unloads, recency, and running calls per adapter."""

from __future__ import annotations

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from gateway.config import WorkerSpec
from gateway.upstream.load.lora import listed
from tests.support.factories import make_worker


def test_a_poll_keeps_recency_and_adds_new_ones_as_most_recent() -> None:
    w = make_worker(WorkerSpec("h", 1))
    w.loras_listed(["b", "a"], w.lora_changes)
    assert list(w.loras) == ["a", "b"]
    w.lora_used("a")  # the most recently used now
    w.loras_listed(["a", "b", "c"], w.lora_changes)
    assert list(w.loras) == ["b", "a", "c"]


def test_a_poll_overtaken_by_the_gateways_own_load_is_dropped() -> None:
    w = make_worker(WorkerSpec("h", 1))
    asked = w.lora_changes
    w.lora_loaded("x")
    w.loras_listed([], asked)  # asked before the load ended: it may miss it
    assert list(w.loras) == ["x"]
    w.lora_unloaded("x")
    assert list(w.loras) == []


def test_running_calls_are_counted_per_adapter() -> None:
    w = make_worker(WorkerSpec("h", 1))
    w.lora_used("x")
    w.lora_used("x")
    w.lora_freed("x")
    assert w.lora_calls == {"x": 1}
    w.lora_freed("x")
    assert w.lora_calls == {}


def test_a_listed_answer_is_cut_after_the_cap() -> None:
    reply = pb.ListLoadedLoRAAdaptersResponse(
        loaded_adapters=[pb.LoadedLoRAAdapter(lora_id=f"a{i}") for i in range(200_000)]
    )
    kept, more = listed(reply.SerializeToString(), 256)
    ids = [a.lora_id for a in pb.ListLoadedLoRAAdaptersResponse.FromString(kept).loaded_adapters]
    assert ids == [f"a{i}" for i in range(256)] and more
    short = pb.ListLoadedLoRAAdaptersResponse(loaded_adapters=reply.loaded_adapters[:3])
    assert listed(short.SerializeToString(), 256) == (short.SerializeToString(), False)
