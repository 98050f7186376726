"""The bounded `tenant` label: heavy tenants keep their name among crowds of light ones,
no more than size + 1 labels are ever live, every lost name is reported (and its series
removed from the metrics), and the same calls always give the same labels."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from gateway.app.metrics import Metrics
from gateway.core import verdicts
from gateway.flow.labels import OTHER, Labelled, TenantLabels
from gateway.flow.metrics import FLOW_OUTCOMES, flow_outcome
from gateway.observability.record import CallRecord
from tests.support.factories import make_registry

SGL = "sglang.grpc.scheduler.SglangScheduler"


def mixed_calls(seed: int, calls: int, heavy: int, share: float, light: int) -> list[str]:
    """`heavy` tenants taking `share` of the calls each, the rest spread over `light`
    tenants."""
    rng = random.Random(seed)
    names = [f"heavy-{i}" for i in range(heavy)]
    out = []
    for _ in range(calls):
        pick = rng.random()
        index = int(pick / share)
        out.append(names[index] if index < heavy else f"light-{rng.randrange(light)}")
    return out


def run(labels: TenantLabels, tenants: list[str]) -> list[Labelled]:
    return [labels.count(tenant) for tenant in tenants]


def test_a_tenant_is_named_from_its_second_call_until_it_loses_its_entry() -> None:
    labels = TenantLabels(size=2)
    assert labels.count("a") == (OTHER, ())  # an entry, but one call: not named yet
    assert labels.count("a") == ("a", ())
    assert labels.count("b") == (OTHER, ())
    # Full: c and one call of each entry cancel out; b is down to 0 (never named).
    assert labels.count("c") == (OTHER, ())
    assert labels.tenants() == ["a"]
    assert labels.count("c") == (OTHER, ())  # into b's freed entry
    assert labels.count("c") == ("c", ())
    assert labels.count("d") == (OTHER, ("a",))  # a down to 0: named, so reported
    assert labels.tenants() == ["c"]


def test_name_after_1_names_a_tenant_as_soon_as_it_holds_an_entry() -> None:
    labels = TenantLabels(size=2, name_after=1)
    assert run(labels, ["a", "a", "b"]) == [("a", ()), ("a", ()), ("b", ())]
    assert labels.count("c") == (OTHER, ("b",))
    assert labels.count("c") == ("c", ())
    assert labels.count("d") == (OTHER, ("a", "c"))
    assert labels.tenants() == []


def test_heavy_tenants_keep_their_label_among_many_light_ones() -> None:
    # 3 tenants with 15% of the calls each (over 1/(size+1) = 11%), 55% over 1000 others.
    tenants = mixed_calls(seed=17, calls=20_000, heavy=3, share=0.15, light=1000)
    labels = TenantLabels(size=8)
    result = run(labels, tenants)
    settled = list(zip(tenants, result, strict=True))[200:]
    for tenant, labelled in settled:
        if tenant.startswith("heavy-"):
            assert labelled.label == tenant
            assert tenant not in labelled.evicted
    light = [labelled.label for tenant, labelled in settled if tenant.startswith("light-")]
    assert light.count(OTHER) > 0.99 * len(light)  # the crowd lands in other
    assert {f"heavy-{i}" for i in range(3)} <= set(labels.tenants())


def test_never_more_than_size_plus_one_labels_live_under_1000_tenants() -> None:
    size = 8
    labels = TenantLabels(size=size, name_after=1, halve_every=500)  # the most churn
    live: set[str] = set()  # as the metrics see it: add each label, drop each eviction
    seen: set[str] = set()
    rng = random.Random(3)
    for _ in range(30_000):
        # Half the calls over 30 tenants, ranked (a long tail), half over 1000.
        rank = int(rng.paretovariate(1.0)) % 30 if rng.random() < 0.5 else rng.randrange(1000)
        tenant = f"t{rank}"
        seen.add(tenant)
        label, evicted = labels.count(tenant)
        live.difference_update(evicted)
        live.add(label)
        assert len(live) <= size + 1
        assert live - {OTHER} == set(labels.tenants())  # every lost entry was reported
    assert len(seen) > 900


def test_evictions_are_reported_once_each() -> None:
    tenants = mixed_calls(seed=9, calls=10_000, heavy=2, share=0.1, light=1000)
    labels = TenantLabels(size=4, halve_every=1000)
    held: set[str] = set()
    admitted: list[str] = []
    evicted: list[str] = []
    for label, gone in run(labels, tenants):
        assert set(gone) <= held  # only a tenant holding an entry can lose it
        held.difference_update(gone)
        evicted.extend(gone)
        if label != OTHER and label not in held:
            held.add(label)
            admitted.append(label)
    assert len(evicted) > 100
    # Every admission ends in exactly one eviction, but for the entries still held.
    assert sorted(evicted + labels.tenants()) == sorted(admitted)


def test_counts_are_halved_so_the_ranking_follows_recent_traffic() -> None:
    labels = TenantLabels(size=1, halve_every=4)
    assert run(labels, ["old"] * 3) == [(OTHER, ()), ("old", ()), ("old", ())]
    # The 4th call halves first (old: 3 -> 1), so one call of new ends old's entry;
    # without halving it would take three.
    assert labels.count("new") == (OTHER, ("old",))
    assert run(labels, ["new", "new"]) == [(OTHER, ()), ("new", ())]
    assert labels.tenants() == ["new"]


def test_the_same_calls_give_the_same_labels() -> None:
    tenants = mixed_calls(seed=5, calls=5_000, heavy=2, share=0.2, light=300)
    first = run(TenantLabels(size=6, halve_every=700), tenants)
    again = run(TenantLabels(size=6, halve_every=700), tenants)
    assert first == again


def test_a_tenant_named_other_is_never_told_apart_and_size_zero_names_nobody() -> None:
    labels = TenantLabels(size=3)
    assert labels.count(OTHER) == (OTHER, ())
    assert labels.tenants() == []
    nobody = TenantLabels(size=0)
    assert run(nobody, ["a", "b", "a"]) == [(OTHER, ())] * 3


@pytest.mark.parametrize(
    ("size", "name_after", "halve_every"), [(-1, 2, 10), (3, 0, 10), (3, 2, 0)]
)
def test_bad_bounds_are_refused(size: int, name_after: int, halve_every: int) -> None:
    with pytest.raises(ValueError):
        TenantLabels(size=size, name_after=name_after, halve_every=halve_every)


def flow_record(
    tenant: str, code: str = "OK", reason: verdicts.Verdict | None = None
) -> CallRecord:
    record = CallRecord(rpc="Generate", service=SGL, model="m", code=code, verdict=reason)
    record.tenant, record.priority, record.queued_s = tenant, "standard", 0.0
    record.attempts = 0 if reason is not None else 1
    return record


def tenant_series(metrics: Metrics) -> dict[tuple[str, str], float]:
    return {
        (sample.labels["tenant"], sample.labels["outcome"]): sample.value
        for family in metrics.prometheus.collect()
        if family.name == "gateway_flow_tenant_outcomes"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_metrics_count_outcomes_per_tenant_and_remove_evicted_series() -> None:
    metrics = Metrics(make_registry(), CollectorRegistry(), tenant_labels=2)
    limited = verdicts.Verdict(verdicts.Reason.RATE_LIMITED, "over its rate limit")
    metrics.observe(flow_record("a"))  # a's first call: other
    metrics.observe(flow_record("a"))
    metrics.observe(flow_record("a", "RESOURCE_EXHAUSTED", limited))
    metrics.observe(flow_record("b", "CANCELLED"))  # attempts 1: admitted, then cancelled
    metrics.observe(flow_record("b"))
    assert tenant_series(metrics) == {
        ("other", "admitted"): 2,
        ("a", "admitted"): 1,
        ("a", "rate_limited"): 1,
        ("b", "admitted"): 1,
    }
    by_class = {"class": "standard", "outcome": "rate_limited"}
    assert metrics.prometheus.get_sample_value("gateway_flow_outcomes_total", by_class) == 1
    # Full: each call of c counts a (3) and b (2) down; b reaches 0 and its series goes.
    metrics.observe(flow_record("c"))
    metrics.observe(flow_record("c"))
    assert tenant_series(metrics) == {
        ("other", "admitted"): 4,
        ("a", "admitted"): 1,
        ("a", "rate_limited"): 1,
    }


def test_metrics_keep_at_most_size_plus_one_tenant_labels_live() -> None:
    metrics = Metrics(make_registry(), CollectorRegistry(), tenant_labels=5)
    rng = random.Random(11)
    ever: set[str] = set()
    for _ in range(3000):
        # Half the calls over 30 tenants, ranked (a long tail), half over 1000.
        rank = int(rng.paretovariate(1.0)) % 30 if rng.random() < 0.5 else rng.randrange(1000)
        metrics.observe(flow_record(f"t{rank}"))
        live = {tenant for tenant, _ in tenant_series(metrics)}
        assert len(live) <= 6
        ever |= live
    assert len(ever) > 6  # names came and went: the bound held through evictions


def test_rate_limits_without_flow_control_are_counted_by_tenant_only() -> None:
    metrics = Metrics(make_registry(), CollectorRegistry())
    limited = verdicts.Verdict(verdicts.Reason.RATE_LIMITED, "over its rate limit")
    for code, verdict in (("OK", None), ("OK", None), ("RESOURCE_EXHAUSTED", limited)):
        record = flow_record("a", code, verdict)
        record.priority = record.queued_s = None  # no `flow:` section: no class
        metrics.observe(record)
    assert tenant_series(metrics) == {
        ("other", "admitted"): 1,
        ("a", "admitted"): 1,
        ("a", "rate_limited"): 1,
    }
    sample = metrics.prometheus.get_sample_value
    assert (
        sample("gateway_flow_outcomes_total", {"class": "standard", "outcome": "admitted"}) is None
    )


def test_rate_limited_is_its_own_outcome() -> None:
    limited = verdicts.Verdict(verdicts.Reason.RATE_LIMITED, "over its rate limit")
    assert flow_outcome(flow_record("a", "RESOURCE_EXHAUSTED", limited)) == "rate_limited"
    assert "rate_limited" in FLOW_OUTCOMES
