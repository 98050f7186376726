"""Session affinity: the bounded table (LRU, idle expiry), and placement keeping a
session's legs on their bound workers while they can take it, rebinding when not."""

from __future__ import annotations

import tracemalloc

import pytest

from gateway.config import AffinityConfig, ModelSettings, WorkerSpec
from gateway.core.roles import Role, Runtime
from gateway.placement.affinity import (
    ENTRY_BYTES,
    MAX_SESSION_KEY,
    Affinity,
    AffinityResult,
    SessionTable,
    affinity_result,
    session_key,
)
from gateway.placement.decision import Decision
from gateway.placement.placing import Placing
from gateway.placement.policies import Hints
from gateway.upstream.registry import Registry
from gateway.upstream.worker import Worker, WorkerStatus
from tests.support.factories import make_placer, make_registry, make_worker

REG = Role.REGULAR


def test_the_table_holds_at_most_max_sessions_evicting_the_least_recently_used() -> None:
    table = SessionTable(max_sessions=2, ttl_s=60)
    table.bind(("a", "m", REG), "w1", now=0)
    table.bind(("b", "m", REG), "w2", now=1)
    assert table.get(("a", "m", REG), now=2) == "w1"  # used: b is now the oldest
    table.bind(("c", "m", REG), "w3", now=3)
    assert len(table) == 2
    assert table.get(("b", "m", REG), now=4) is None
    assert table.get(("a", "m", REG), now=4) == "w1"
    assert table.get(("c", "m", REG), now=4) == "w3"


def test_a_binding_unused_for_ttl_expires_and_use_keeps_it_young() -> None:
    table = SessionTable(max_sessions=10, ttl_s=10)
    table.bind(("a", "m", REG), "w1", now=0)
    table.bind(("b", "m", REG), "w2", now=0)
    assert table.get(("a", "m", REG), now=9) == "w1"
    assert table.get(("a", "m", REG), now=18) == "w1"  # 9 s after its last use
    assert len(table) == 1  # b, unused for 18 s, went at that lookup
    assert table.get(("a", "m", REG), now=28) is None
    assert len(table) == 0


def test_expiry_on_insert_too() -> None:
    table = SessionTable(max_sessions=10, ttl_s=5)
    for i in range(5):
        table.bind((f"s{i}", "m", REG), "w", now=i)
    table.bind(("new", "m", REG), "w", now=7)
    assert len(table) == 3  # s0, s1, s2 (used at 0, 1, 2) expired by 7


def test_outcomes_and_rebinding() -> None:
    assert affinity_result(None, "w1") is AffinityResult.MISS
    assert affinity_result("w1", "w1") is AffinityResult.HIT
    assert affinity_result("w1", "w2") is AffinityResult.REBIND


def test_legs_and_models_are_bound_apart() -> None:
    affinity = Affinity(AffinityConfig(header="x-session-id"))
    p, d, r = worker(1, Role.PREFILL), worker(2, Role.DECODE), worker(3)
    affinity.placed("s", "m", {Role.PREFILL: p, Role.DECODE: d}, {}, now=0)
    affinity.placed("s", "other", {REG: r}, {}, now=0)
    assert dict(affinity.bound("s", "m", (Role.PREFILL, Role.DECODE), now=1)) == {
        Role.PREFILL: p.id,
        Role.DECODE: d.id,
    }
    assert dict(affinity.bound("s", "m", (REG,), now=1)) == {}
    assert dict(affinity.bound("s", "other", (REG, Role.ENCODE), now=1)) == {REG: r.id}
    assert affinity.outcomes == {("m", AffinityResult.MISS): 2, ("other", AffinityResult.MISS): 1}


def test_a_session_key_is_bounded() -> None:
    assert session_key("abc") == "abc"
    assert session_key("x" * MAX_SESSION_KEY) == "x" * MAX_SESSION_KEY
    assert session_key("x" * (MAX_SESSION_KEY + 1)) is None
    assert session_key("") is None


# -- placement with affinity ---------------------------------------------------------------


def worker(port: int, role: Role = REG, pairing: str = "") -> Worker:
    spec = WorkerSpec("h", port, "m", Runtime.SGLANG, role)
    return make_worker(spec, role=role, pairing=pairing)


def up(registry: Registry, port: int, role: Role = REG) -> Worker:
    added = worker(port, role)
    registry.add(added)
    added.connected = True
    added.probe.healthy = True
    added.signalled("test")
    assert added.status is WorkerStatus.READY
    return added


def placing(registry: Registry, affinity: Affinity, session: str | None) -> Placing:
    placer = make_placer(registry, affinity=affinity)
    legs = placer.legs("m", multimodal=False)
    return Placing(
        placer, "m", Runtime.SGLANG, Hints(), (), legs, receiver_only=False, session=session
    )


def placed(place: Placing, tried: tuple[str, ...] = ()) -> Decision:
    decided = place(tried)
    assert isinstance(decided, Decision)
    return decided


@pytest.fixture
def affinity() -> Affinity:
    return Affinity(AffinityConfig(header="x-session-id"))


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "least_inflight", "random"])
def test_a_session_stays_on_its_worker_and_moves_when_it_cannot_take_it(
    affinity: Affinity, policy: str
) -> None:
    registry = make_registry(lambda model: ModelSettings(policy=policy, max_inflight=1))
    a, b, c = up(registry, 1), up(registry, 2), up(registry, 3)
    place = placing(registry, affinity, "s")
    first = placed(place).primary
    assert all(placed(place).primary is first for _ in range(10))  # round robin, yet kept
    first.inflight = 1  # at its limit: placed afresh, and bound there
    second = placed(place).primary
    assert second is not first
    first.inflight = 0
    assert placed(place).primary is second  # the new binding holds
    assert placed(place, (second.id,)).primary is not second  # a retry never goes back
    counts = {kind: affinity.outcomes.get(("m", kind), 0) for kind in AffinityResult}
    assert counts == {AffinityResult.MISS: 1, AffinityResult.HIT: 11, AffinityResult.REBIND: 2}
    assert {a, b, c} >= {first, second}


def test_no_session_is_placed_by_the_policy_alone(affinity: Affinity) -> None:
    registry = make_registry()
    up(registry, 1), up(registry, 2)
    place = placing(registry, affinity, None)
    assert len({placed(place).primary for _ in range(4)}) == 2
    assert affinity.outcomes == {} and len(affinity.table) == 0


def test_pd_legs_keep_their_own_bindings(affinity: Affinity) -> None:
    registry = make_registry()
    prefills = [up(registry, port, Role.PREFILL) for port in (1, 2)]
    decodes = [up(registry, port, Role.DECODE) for port in (3, 4)]
    place = placing(registry, affinity, "s")
    first = placed(place)
    for _ in range(5):
        again = placed(place)
        assert dict(again.workers) == dict(first.workers)
    # The bound decode fails in this call: the retry moves the decode only.
    retried = placed(place, (first.workers[Role.DECODE].id,))
    assert retried.workers[Role.PREFILL] is first.workers[Role.PREFILL]
    assert retried.workers[Role.DECODE] is not first.workers[Role.DECODE]
    assert retried.workers[Role.DECODE] in decodes and first.workers[Role.PREFILL] in prefills
    assert affinity.outcomes[("m", AffinityResult.REBIND)] == 1


def bytes_per_binding(session_length: int, count: int = 20_000) -> float:
    """What the table holds per binding, measured (the keys made before, freed after;
    one bound first, so what the first binding alone allocates is not counted)."""
    table = SessionTable(max_sessions=count + 1, ttl_s=60)
    table.bind(("warm", "m", REG), "w1", now=0)
    keys = [(f"{i:0{session_length}d}", "m", REG) for i in range(count)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in keys:
            table.bind(key, "w1", now=0)
        del keys
        return (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()


def test_a_binding_costs_the_same_whatever_the_sessions_length() -> None:
    """Keys are stored as 16-byte digests: a 256-character session costs what a short
    one does, within ENTRY_BYTES (the figure the docs give)."""
    short, longest = bytes_per_binding(8), bytes_per_binding(MAX_SESSION_KEY)
    assert longest <= ENTRY_BYTES and short <= ENTRY_BYTES
    assert abs(longest - short) < 16
