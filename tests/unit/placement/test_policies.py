"""Policies are pure decisions over a snapshot of candidates."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from gateway.placement.policies import Hints, policy_class, rotate_after
from gateway.placement.policies.consistent_hash import ConsistentHash
from gateway.placement.policies.least_inflight import LeastInflight
from gateway.placement.policies.manual import Manual
from gateway.placement.policies.power_of_two import PowerOfTwo
from gateway.placement.policies.round_robin import RoundRobin
from tests.support.policies import C


def ids(picks: list[C | None]) -> list[str]:
    return [p.id if p else "-" for p in picks]


def test_round_robin_rotates_in_id_order() -> None:
    policy = RoundRobin()
    pool = [C("a"), C("b"), C("c")]
    assert ids([policy.pick(pool, Hints()) for _ in range(4)]) == ["a", "b", "c", "a"]


def test_round_robin_rotation_is_stable_when_workers_come_and_go() -> None:
    policy = RoundRobin()
    assert policy.pick([C("a"), C("b"), C("c")], Hints()) == C("a")
    # b leaves: the turn goes to the next id after a, not to whatever index 1 now is.
    assert policy.pick([C("a"), C("c")], Hints()) == C("c")
    # a new worker between c and the wrap point takes its place in the order.
    assert policy.pick([C("a"), C("c"), C("d")], Hints()) == C("d")
    assert policy.pick([C("a"), C("c"), C("d")], Hints()) == C("a")


def test_rotate_after_wraps_and_tolerates_a_departed_last() -> None:
    assert rotate_after(["a", "b"], None) == 0
    assert rotate_after(["a", "b"], "b") == 0
    assert rotate_after(["a", "c"], "b") == 1


@given(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=8, unique=True))
def test_round_robin_visits_every_worker_once_per_cycle(names: list[str]) -> None:
    pool = [C(n) for n in sorted(names)]
    policy = RoundRobin()
    picks = [policy.pick(pool, Hints()) for _ in range(len(pool))]
    assert sorted(ids(picks)) == sorted(names)


def test_power_of_two_takes_the_less_loaded_of_its_two_samples() -> None:
    """Three candidates: the busiest is never the less loaded of any two, the middle one
    is whenever the idle one is not sampled (a third of the time)."""
    policy = PowerOfTwo(random.Random(7))
    pool = [C("busy", 5), C("idle", 0), C("some", 3)]
    picks = Counter(policy.pick(pool, Hints()).id for _ in range(300))  # type: ignore[union-attr]
    assert picks["busy"] == 0
    assert 60 <= picks["some"] <= 140 and picks["idle"] == 300 - picks["some"]
    assert PowerOfTwo().pick([C("solo", 9)], Hints()) == C("solo", 9)


def test_least_inflight_prefers_idle_and_rotates_ties() -> None:
    policy = LeastInflight()
    assert policy.pick([C("a", 2), C("b", 1), C("c", 3)], Hints()) == C("b", 1)
    tied = [C("a"), C("b"), C("c")]
    assert ids([policy.pick(tied, Hints()) for _ in range(3)]) == ["c", "a", "b"]


def test_consistent_hash_keeps_a_key_on_its_worker_while_it_stays() -> None:
    policy = ConsistentHash()
    pool = [C("a"), C("b"), C("c"), C("d")]
    owner = {f"k{i}": policy.pick(pool, Hints(routing_key=f"k{i}")) for i in range(40)}
    assert len({o.id for o in owner.values() if o}) > 1  # keys spread over workers
    smaller = [c for c in pool if c.id != "d"]
    for key, worker in owner.items():
        assert worker is not None
        if worker.id != "d":  # only keys of the departed worker move
            assert policy.pick(smaller, Hints(routing_key=key)) == worker


def test_consistent_hash_without_key_falls_back_to_round_robin() -> None:
    policy = ConsistentHash()
    pool = [C("a"), C("b")]
    assert ids([policy.pick(pool, Hints()) for _ in range(3)]) == ["a", "b", "a"]


def test_manual_picks_the_named_worker_or_declines() -> None:
    policy = Manual()
    pool = [C("a"), C("b")]
    assert policy.pick(pool, Hints(target_worker="b")) == C("b")
    assert policy.pick(pool, Hints(target_worker="z")) is None
    assert policy.pick(pool, Hints()) == C("a")


def test_every_policy_returns_none_for_no_candidates() -> None:
    for name in ("round_robin", "random", "power_of_two", "least_inflight", "consistent_hash"):
        assert policy_class(name)().pick([], Hints(routing_key="k")) is None
