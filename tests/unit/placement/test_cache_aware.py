"""Cache-aware placement: the cost rule, the balance guard, and following KV events."""

from __future__ import annotations

from typing import Any

import pytest
from smg_grpc_proto.generated import common_pb2 as kv

from gateway.config import KvConfig
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.kv.prefix import Prefix
from gateway.placement.policies import Choice, Hints, Unattainable
from gateway.placement.policies.base import rendezvous_order
from gateway.placement.policies.cache_aware import CacheAware, cheapest
from gateway.upstream.load.kv_batches import Gap
from tests.support.cache_aware import PROMPT, follower, stored
from tests.support.factories import worker_on

SETTINGS = KvConfig()  # 0.01 per uncached token, balance 1.5 x lowest + 4


def said(choice: Choice[Any] | Unattainable | None) -> Choice[Any] | None:
    """The choice's worker, rank and expected hit (what these tests are about), without
    the load and backlog it carries for latency learning."""
    assert not isinstance(choice, Unattainable)  # cache-aware predicts nothing
    return None if choice is None else Choice(choice.worker, choice.rank, choice.expected_cached)


def test_the_most_cached_worker_wins_when_loads_are_close() -> None:
    # 512 uncached tokens cost 5.12 queued requests; a full hit costs nothing.
    assert cheapest([3, 3, 3], [512, 0, 256], SETTINGS, [0, 1, 2]) == 1
    assert cheapest([0, 4, 0], [512, 0, 512], SETTINGS, [0, 1, 2]) == 1  # 4 < 5.12


def test_the_balance_guard_keeps_affinity_from_piling_up() -> None:
    # Fully cached but 20 in flight, against an idle worker: 20 > 1.5 x 0 + 4.
    assert cheapest([0, 20], [512, 0], SETTINGS, [0, 1]) == 0
    # Within the guard (6 <= 1.5 x 2 + 4 = 7), the cache still decides.
    assert cheapest([2, 6], [512, 0], SETTINGS, [0, 1]) == 1


def test_ties_go_to_lower_load_then_to_rotation() -> None:
    assert cheapest([2, 1], [0, 100], SETTINGS, [0, 1]) == 1  # 2.0 vs 2.0: load 1 wins
    assert cheapest([1, 1], [0, 0], SETTINGS, [1, 0]) == 1


def test_placements_teach_the_index_for_workers_without_events() -> None:
    index = KvIndex()
    policy = CacheAware(index, SETTINGS, stale_after_s=3)
    a, b = worker_on(1), worker_on(2)
    prompt = Prefix(PROMPT)
    first = policy.pick([a, b], Hints(prefix=prompt))
    tie = prompt.anchor()
    assert tie is not None and first is [a, b][rendezvous_order([a.id, b.id], tie)[0]]
    again = policy.pick([a, b], Hints(prefix=Prefix(PROMPT)))
    assert again is first  # assumed cached there
    fresh = Prefix([7] * 512)
    other = policy.pick([a, b], Hints(prefix=fresh))
    anchor = fresh.anchor()
    assert anchor is not None  # a tie, broken by the prompt: alike on every gateway
    assert other is [a, b][rendezvous_order([a.id, b.id], anchor)[0]]


def test_a_follower_applies_events_in_order_and_spots_gaps() -> None:
    index = KvIndex()
    f = follower(index)
    f.apply(stored(1, [11, 12], PROMPT, tier=kv.KV_CACHE_TIER_DEVICE))
    assert index.matched_tokens(Prefix(PROMPT), ["h:1"], 0) == {("h:1", 0): 32}
    assert f.worker.load is not None and f.worker.load.running == 2
    f.apply(stored(1, [11, 12], PROMPT))  # a duplicate changes nothing
    removed = kv.KvCacheEvent(removed=kv.KvBlocksRemoved(block_hashes=[12]))
    f.apply(kv.KvEventBatch(sequence_number=2, events=[removed]))
    assert index.matched_tokens(Prefix(PROMPT), ["h:1"], 0) == {("h:1", 0): 16}
    with pytest.raises(Gap):
        f.apply(stored(4, [13], PROMPT[32:]))
    assert f.cursors == {0: 2}


def test_host_tier_and_remote_blocks_are_not_cached_prompts() -> None:
    index = KvIndex()
    f = follower(index)
    f.apply(stored(1, [11], PROMPT, tier=kv.KV_CACHE_TIER_HOST))
    f.apply(stored(2, [21], PROMPT, locality=kv.KV_CACHE_LOCALITY_REMOTE))
    assert index.matched_tokens(Prefix(PROMPT), ["h:1"], 0) == {}


def test_lora_blocks_match_only_requests_of_that_lora() -> None:
    index = KvIndex()
    f = follower(index)
    f.apply(stored(1, [11, 12], PROMPT, lora_name="finance"))
    assert index.matched_tokens(Prefix(PROMPT), ["h:1"], 0) == {}
    assert index.matched_tokens(Prefix(PROMPT, "lora:finance"), ["h:1"], 0) == {("h:1", 0): 32}


def test_a_snapshot_resyncs_a_rank_and_heartbeats_only_carry_load() -> None:
    index = KvIndex()
    f = follower(index)
    f.apply(stored(5, [11, 12], PROMPT))
    cleared = kv.KvCacheEvent(cleared=kv.KvCacheCleared())
    snapshot = kv.KvEventBatch(
        sequence_number=9, events=[cleared], snapshot=kv.KvSnapshotChunk(index=0, count=2)
    )
    f.apply(snapshot)
    assert index.matched_tokens(Prefix(PROMPT), ["h:1"], 0) == {}
    chunk = stored(10, [31], PROMPT)
    chunk.snapshot.CopyFrom(kv.KvSnapshotChunk(index=1, count=2))
    f.apply(chunk)
    heartbeat = kv.KvEventBatch(
        sequence_number=10, load=kv.EngineLoad(running_requests=7, load_only=True)
    )
    f.apply(heartbeat)
    assert f.cursors == {0: 10}
    assert f.worker.load is not None and f.worker.load.running == 7
    assert index.matched_tokens(Prefix(PROMPT), ["h:1"], 0) == {("h:1", 0): 16}


def test_a_data_parallel_worker_gets_the_rank_that_holds_the_prompt() -> None:
    index = KvIndex()
    index.follow(("h:1", 0))
    f = follower(index)
    batch = stored(1, [11, 12], PROMPT)
    batch.dp_rank = 1
    f.apply(batch)
    policy = CacheAware(index, SETTINGS, stale_after_s=3)
    prefix = Prefix(PROMPT)
    busy = worker_on(2)
    busy.inflight = 5  # h:1 reports 2 running: the cached one is cheaper (6.8 vs 10.12)
    hints = Hints(prefix=prefix)
    assert said(policy.choose([f.worker, busy], hints)) == Choice(f.worker, 1, 32)
    assert hints == Hints(prefix=prefix)  # the hints are not written into
    adapter = engine_adapters()[Runtime.SGLANG]
    raw = adapter.with_dp_rank(b"", 1)
    request: Any = adapter.rpcs["Generate"].request_type.FromString(raw)  # a generated message
    assert request.data_parallel_rank == 1


def test_the_expected_hit_is_what_the_workers_events_show_not_where_it_was_placed() -> None:
    """Placement memory steers placement (a burst, a session, goes back where it went),
    but the hit the gateway expects is what the worker's own events say it holds: a
    prompt whose first request is still in its prefill is not stored yet, and blocks an
    eviction event removed are computed again."""
    index = KvIndex()
    f = follower(index)
    f.apply(kv.KvEventBatch(sequence_number=1))  # following h:1: its events are the facts
    policy = CacheAware(index, SETTINGS, stale_after_s=3)
    a, b = f.worker, worker_on(2)
    assert said(policy.choose([a], Hints(prefix=Prefix(PROMPT)))) == Choice(a, None, 0)
    # The burst's second request, before the worker has stored the first's blocks.
    assert said(policy.choose([a], Hints(prefix=Prefix(PROMPT)))) == Choice(a, None, 0)
    f.apply(stored(2, list(range(100, 132)), PROMPT))  # its 32 blocks are stored
    # All of them but the last, which holds the token the engine computes again.
    assert said(policy.choose([a], Hints(prefix=Prefix(PROMPT)))) == Choice(a, None, 496)
    evicted = kv.KvCacheEvent(removed=kv.KvBlocksRemoved(block_hashes=list(range(116, 132))))
    f.apply(kv.KvEventBatch(sequence_number=3, events=[evicted]))  # the last 16 evicted
    # Still placed where it went (it is cached again there), expecting only what is left.
    assert said(policy.choose([a, b], Hints(prefix=Prefix(PROMPT)))) == Choice(a, None, 256)
