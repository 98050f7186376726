"""A serving process of `--processes N` gets its share of a tenant's budgets, unless a
shared store charges them for the whole fleet: then each process charges the store the
whole budget (a split one would shrink the fleet's to a process's share)."""

from __future__ import annotations

from gateway.config import build_config
from gateway.core.member import Member
from gateway.scale.member import serving_config

TENANTS = {"alice": {"requests_per_minute": 600, "tokens_per_minute": 90_000, "max_inflight": 8}}


def test_budgets_are_split_without_a_store_and_whole_with_one() -> None:
    member = Member(0, 3, "/tmp")
    alone = serving_config(build_config({"tenants": TENANTS}), member, 1, ())
    shared = build_config({"tenants": TENANTS, "state": {"url": "redis://127.0.0.1:6379/0"}})
    fleet = serving_config(shared, member, 1, ())
    split, whole = alone.tenants["alice"], fleet.tenants["alice"]
    assert (split.requests_per_minute, split.tokens_per_minute) == (200, 30_000)
    assert (whole.requests_per_minute, whole.tokens_per_minute) == (600, 90_000)
    assert split.max_inflight == whole.max_inflight == 3  # in flight: each process's own
