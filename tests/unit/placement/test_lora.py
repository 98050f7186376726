"""LoRA adapter affinity's pure choice: holders first, then room, then an unused adapter
to unload (the least recently used), else everyone."""

from __future__ import annotations

from gateway.placement.lora import Holding, Tier, adapter_of, evictable, preferred


def holding(*loaded: str, **in_use: int) -> Holding:
    return Holding(loaded, in_use)


def test_workers_holding_the_adapter_come_first() -> None:
    found = preferred("x", ["a", "b", "c"], [holding("y"), holding("x", "y"), holding("x")], 2)
    assert (found.workers, found.tier) == (["b", "c"], Tier.LOADED)


def test_a_worker_loading_it_counts_as_holding_it() -> None:
    found = preferred("x", ["a", "b"], [holding(), holding(x=1)], 2)
    assert (found.workers, found.tier) == (["b"], Tier.LOADED)


def test_else_workers_with_room() -> None:
    found = preferred("x", ["a", "b"], [holding("y", "z"), holding("y")], 2)
    assert (found.workers, found.tier) == (["b"], Tier.SPARE)


def test_adapters_being_loaded_take_room() -> None:
    found = preferred("x", ["a", "b"], [holding("y", z=1), holding("y")], 2)
    assert (found.workers, found.tier) == (["b"], Tier.SPARE)


def test_else_workers_with_an_unused_adapter_to_unload() -> None:
    full_busy = holding("y", "z", y=1, z=2)
    full_idle = holding("y", "z", y=1)
    found = preferred("x", ["a", "b"], [full_busy, full_idle], 2)
    assert (found.workers, found.tier) == (["b"], Tier.EVICT)


def test_else_every_candidate() -> None:
    found = preferred("x", ["a", "b"], [holding("y", y=1), holding("z", z=1)], 1)
    assert (found.workers, found.tier) == (["a", "b"], Tier.FULL)


def test_the_least_recently_used_unused_adapter_goes() -> None:
    assert evictable(holding("old", "mid", "new", old=1), keep="x") == "mid"
    assert evictable(holding("x", "new"), keep="x") == "new"
    assert evictable(holding("y", y=3), keep="x") is None


def test_the_adapter_a_namespace_names() -> None:
    assert adapter_of("lora:sql") == "sql"
    assert adapter_of("") == ""
    assert adapter_of("other") == ""
