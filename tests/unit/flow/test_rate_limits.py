"""Tenant rate limits as token buckets: both budgets checked before either is taken, the
wait until a call fits, settlement from what the call really used, and bounded memory."""

from __future__ import annotations

import pytest

from gateway.flow.budget import REQUESTS, TOKENS, Charge, OverBudget, RateLimits

LIMITS = {"alice": (2, None), "bob": (None, 1000), "carol": (10, 600)}


def limits(tenant: str) -> tuple[int | None, int | None]:
    return LIMITS.get(tenant, (None, None))


def test_a_tenant_without_limits_is_not_charged() -> None:
    assert RateLimits(limits).take("dave", 10**9, 0.0) is None


def test_requests_per_minute_refuses_the_third_call_until_the_bucket_refills() -> None:
    rates = RateLimits(limits)
    assert rates.take("alice", 5, 0.0) == Charge("alice", 5)
    assert rates.take("alice", 5, 0.0) == Charge("alice", 5)
    refused = rates.take("alice", 5, 0.0)
    assert refused == OverBudget(REQUESTS, 2, 30.0)  # one request per 30 s comes back
    assert isinstance(rates.take("alice", 5, 10.0), OverBudget)
    assert rates.take("alice", 5, 30.0) == Charge("alice", 5)


def test_tokens_are_reserved_and_settled_from_what_was_used() -> None:
    rates = RateLimits(limits)
    charge = rates.take("bob", 800, 0.0)
    assert isinstance(charge, Charge)
    refused = rates.take("bob", 800, 0.0)
    assert isinstance(refused, OverBudget)
    assert (refused.budget, refused.per_minute) == (TOKENS, 1000)
    assert refused.wait_s == pytest.approx(36.0)  # 600 more, at 1000/60 s
    rates.settle(charge, 300, 0.0)  # it used 300: 500 go back
    assert isinstance(rates.take("bob", 700, 0.0), Charge)


def test_a_call_that_used_more_than_reserved_leaves_a_debt() -> None:
    rates = RateLimits(limits)
    charge = rates.take("bob", 100, 0.0)
    assert isinstance(charge, Charge)
    rates.settle(charge, 1600, 0.0)  # 1500 more than reserved: the bucket is at -600
    refused = rates.take("bob", 1, 0.0)
    assert isinstance(refused, OverBudget)
    assert refused.wait_s == pytest.approx(601 * 60 / 1000)


def test_a_refused_call_takes_nothing_from_either_budget() -> None:
    rates = RateLimits(limits)
    assert isinstance(rates.take("carol", 600, 0.0), Charge)
    for _ in range(5):  # tokens run out first: the request budget stays untouched
        assert isinstance(rates.take("carol", 1, 0.0), OverBudget)
    assert rates.take("carol", 1, 6.0) is not None
    charges = [rates.take("carol", 0, 6.0) for _ in range(9)]
    assert all(isinstance(c, Charge) for c in charges)  # 10 requests in all, not fewer
    assert isinstance(rates.take("carol", 0, 6.0), OverBudget)


def test_a_call_that_never_reached_a_worker_gives_everything_back() -> None:
    rates = RateLimits(limits)
    first = rates.take("alice", 5, 0.0)
    assert isinstance(first, Charge)
    rates.settle(first, None, 0.0)
    assert isinstance(rates.take("alice", 5, 0.0), Charge)
    assert isinstance(rates.take("alice", 5, 0.0), Charge)


def test_a_call_bigger_than_a_minute_runs_once_the_bucket_is_full() -> None:
    rates = RateLimits(limits)
    assert isinstance(rates.take("bob", 5000, 0.0), Charge)  # full bucket: runs, into debt
    refused = rates.take("bob", 5000, 0.0)
    assert isinstance(refused, OverBudget)
    # The debt stops at one capacity (-1000, not -4000): full again in 2 minutes, not 5.
    assert refused.wait_s == pytest.approx(2000 * 60 / 1000)


def test_a_debt_is_at_most_one_buckets_capacity() -> None:
    # A worker reporting 2^32-1 completion tokens: the tenant waits two minutes at most,
    # not the days the figure would take to pay back.
    rates = RateLimits(limits)
    charge = rates.take("bob", 100, 0.0)
    assert isinstance(charge, Charge)
    rates.settle(charge, 2**32 - 1, 0.0)
    refused = rates.take("bob", 1, 0.0)
    assert isinstance(refused, OverBudget)
    assert refused.wait_s == pytest.approx(1001 * 60 / 1000)
    assert isinstance(rates.take("bob", 1000, 120.0), Charge)


def test_full_buckets_are_dropped_as_the_table_grows() -> None:
    rates = RateLimits(lambda tenant: (1, None))
    for i in range(1024):
        rates.take(f"t{i}", 0, 0.0)
    assert len(rates) == 1024
    rates.take("late", 0, 60.0)  # a minute on: every old bucket is full again
    assert len(rates) == 1


def test_the_table_is_bounded_in_size_tenants_past_it_share_one_bucket() -> None:
    # Behind a trusted proxy, tenant names are whatever the header says: a flood of names
    # whose buckets are not yet full again cannot grow the table past its bound.
    rates = RateLimits(lambda tenant: (1, None), max_buckets=100)
    for i in range(100):
        assert isinstance(rates.take(f"t{i}", 0, 0.0), Charge)
    first = rates.take("late-1", 0, 0.0)
    assert isinstance(first, Charge)
    assert isinstance(rates.take("late-2", 0, 0.0), OverBudget)  # the shared bucket is used
    assert len(rates) == 101
    rates.settle(first, None, 0.0)  # given back to the bucket it was taken from
    assert isinstance(rates.take("late-2", 0, 0.0), Charge)
    assert isinstance(rates.take("t5", 0, 0.0), OverBudget)  # a known tenant keeps its own
