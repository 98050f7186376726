"""A worker's LoRA adapters as its one writer keeps them: polls, the gateway's own loads
and unloads, recency, and running calls per adapter."""

from __future__ import annotations

from gateway.config import WorkerSpec
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
