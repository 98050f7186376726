"""The prefix index: exact slots from KV events, assumed slots from placements."""

from __future__ import annotations

from pydantic.fields import FieldInfo

from gateway.config import KvConfig
from gateway.kv.holders import PURGE_STEP
from gateway.kv.index import PENDING_BLOCKS, KvIndex, StoredBlock
from gateway.kv.prefix import Prefix, block_hashes

A, B = ("a:1", 0), ("b:1", 0)
PROMPT = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens


def stored(tokens: list[int], engine_base: int, size: int = 16) -> list[StoredBlock]:
    return [
        StoredBlock(engine_base + i, tokens[i * size : (i + 1) * size])
        for i in range(len(tokens) // size)
    ]


def test_blocks_are_chained_and_only_full_blocks_count() -> None:
    hashes = block_hashes(PROMPT, 16, "")
    assert len(hashes) == 3
    assert block_hashes(PROMPT[:32], 16, "") == hashes[:2]
    other_start = block_hashes([0, *PROMPT[1:]], 16, "")
    assert not set(other_start) & set(hashes)  # a change early changes every later block


def test_stored_blocks_match_by_content_whatever_the_engine_hashes() -> None:
    index = KvIndex()
    assert index.store(A, stored(PROMPT, engine_base=7_000), parent_engine_hash=None) == 3
    index.store(B, stored(PROMPT[:16], engine_base=-42), parent_engine_hash=None)
    matched = index.matched_tokens(Prefix(PROMPT), ["a:1", "b:1"], now=0)
    assert matched == {A: 48, B: 16}
    assert index.matched_tokens(Prefix(PROMPT), ["b:1"], now=0) == {B: 16}


def test_a_child_stored_later_chains_on_its_parent_engine_hash() -> None:
    index = KvIndex()
    index.store(A, stored(PROMPT[:16], 1), None)
    index.store(A, [StoredBlock(2, PROMPT[16:32])], parent_engine_hash=1)
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 0) == {A: 32}
    # A parent the index never saw: kept for removal, never a match.
    index.store(B, [StoredBlock(9, PROMPT[16:32])], parent_engine_hash=12345)
    assert index.matched_tokens(Prefix(PROMPT), ["b:1"], 0) == {}
    assert index.size("b:1") == 1 and index.remove(B, [9]) == 1 and index.size("b:1") == 0


def test_removal_by_engine_hash_cuts_the_prefix_there() -> None:
    index = KvIndex()
    index.store(A, stored(PROMPT, 10), None)
    assert index.remove(A, [12]) == 1  # the last block (engines evict from the tail)
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 0) == {A: 32}
    assert index.remove(A, [11]) == 1  # then the one before it
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 0) == {A: 16}
    assert index.remove(A, [11, 999]) == 0


def test_physical_copies_are_counted() -> None:
    index = KvIndex()
    index.store(A, stored(PROMPT[:16], 1), None)
    index.store(A, stored(PROMPT[:16], 2), None)  # same content, another copy
    index.remove(A, [1])
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 0) == {A: 16}
    index.remove(A, [2])
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 0) == {}


def test_clear_and_drop_worker_forget_everything_of_theirs() -> None:
    index = KvIndex()
    index.store(A, stored(PROMPT, 1), None)
    index.store(("a:1", 1), stored(PROMPT, 1), None)
    index.store(B, stored(PROMPT, 1), None)
    index.clear(A)
    assert index.matched_tokens(Prefix(PROMPT), ["a:1", "b:1"], 0) == {("a:1", 1): 48, B: 48}
    index.drop_worker("a:1")
    assert index.matched_tokens(Prefix(PROMPT), ["a:1", "b:1"], 0) == {B: 48}
    assert index.size("a:1") == 0


def test_namespaces_sharing_token_ids_never_match_each_other() -> None:
    index = KvIndex()
    index.store(A, stored(PROMPT, 1), None, namespace="lora:finance")
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 0) == {}
    assert index.matched_tokens(Prefix(PROMPT, "lora:legal"), ["a:1"], 0) == {}
    assert index.matched_tokens(Prefix(PROMPT, "lora:finance"), ["a:1"], 0) == {A: 48}


def test_assumed_blocks_expire_and_are_bounded() -> None:
    index = KvIndex(ttl_s=10, capacity=4)
    index.assume(A, Prefix(PROMPT), now=100)
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], now=105) == {A: 48}
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], now=111) == {}
    index.assume(A, Prefix(PROMPT), now=200)
    index.assume(A, Prefix(list(range(900, 932))), now=201)  # 2 more: capacity 4
    assert index.size("a:1") == 4
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], now=202) == {}  # oldest went first


def test_events_take_over_from_assumptions() -> None:
    index = KvIndex(pending_ttl_s=5)
    index.assume(A, Prefix(PROMPT), now=0)
    index.store(A, stored(PROMPT[:16], 1), None)
    assert index.exact("a:1")
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 0) == {A: 16}
    # A placement on an exact slot is remembered for the pending TTL (5 s here), also
    # across the worker evicting the blocks meanwhile: sending the prompt back where it
    # went keeps affinity, which measured better than moving it (docs/benchmarks.md). What
    # it expects cached there is what the events show stored, never the memory.
    index.assume(A, Prefix(PROMPT), now=0)
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 1) == {A: 48}
    assert index.stored_tokens(Prefix(PROMPT), A, 48) == 16
    index.store(A, [StoredBlock(2, PROMPT[16:32])], parent_engine_hash=1)
    assert index.stored_tokens(Prefix(PROMPT), A, 48) == 32
    index.remove(A, [2])
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 2) == {A: 48}
    assert index.stored_tokens(Prefix(PROMPT), A, 48) == 16
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 6) == {A: 16}  # facts remain


def test_a_placement_remembers_stored_blocks_too_and_a_new_one_renews_the_memory() -> None:
    """Remembering does not look a block up among the stored ones (a cold read a block):
    one the events show stored is remembered as placed too, so it stays held after its
    eviction until the memory expires; placing it again renews the memory."""
    index = KvIndex(pending_ttl_s=5)
    index.store(A, stored(PROMPT[:48], 1), None)
    index.assume(A, Prefix(PROMPT), now=0)
    index.remove(A, [1, 2, 3])
    assert index.stored_tokens(Prefix(PROMPT), A, 48) == 0
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 1) == {A: 48}
    index.assume(A, Prefix(PROMPT), now=4)  # renewed: held until 9, not 5
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 8) == {A: 48}
    assert index.matched_tokens(Prefix(PROMPT), ["a:1"], 10) == {}
    assert len(index._holders) == 0  # nothing stored, nothing remembered: all let go


def test_the_settings_text_names_the_pending_cap() -> None:
    """The config layer sits below the index and cannot import the cap, so its text (and
    the generated configuration reference) writes the number out: kept equal here."""
    text = f"up to {PENDING_BLOCKS} blocks"
    assert text in (KvConfig.__doc__ or "")
    fields: dict[str, FieldInfo] = getattr(KvConfig, "__pydantic_fields__")  # noqa: B009
    assert text in (fields["pending_ttl_s"].description or "")


def test_the_stored_part_of_a_match_is_found_in_long_prompts_too() -> None:
    index = KvIndex(pending_ttl_s=5)
    long = list(range(10_000, 10_000 + 300 * 16))  # 300 blocks: past two strides
    index.store(A, stored(long[: 200 * 16], 1), None)
    index.assume(A, Prefix(long), now=0, stored=200 * 16)
    # Placed on a slot with events: remembered up to PENDING_BLOCKS past what it stores.
    assert index.matched_tokens(Prefix(long), ["a:1"], 1) == {A: (200 + PENDING_BLOCKS) * 16}
    assert index.stored_tokens(Prefix(long), A, (200 + PENDING_BLOCKS) * 16) == 200 * 16
    assert index.stored_tokens(Prefix(long), A, 150 * 16) == 150 * 16  # at most the match
    # Without KV events the placements are all there is; the block holding the prompt's
    # last token is computed again by the engine, whatever is cached.
    index.assume(B, Prefix(long), now=0)
    assert index.stored_tokens(Prefix(long), B, 300 * 16) == 299 * 16


def test_without_events_the_expected_hit_follows_a_cache_of_the_workers_size() -> None:
    """Placement memory keeps both prompts (it steers placement); the hit to expect is
    what a 4-block cache would still hold: the newer prompt whole, the older one's root
    (an engine evicts a prompt's tail first)."""
    index = KvIndex(ttl_s=100, capacity=1000)
    other = list(range(900, 948))  # three blocks of its own
    index.assume(A, Prefix(PROMPT), now=0, kv_tokens=64)  # 4 blocks of 16
    index.assume(A, Prefix(other), now=1, kv_tokens=64)
    matched = index.matched_tokens
    assert matched(Prefix(PROMPT), ["a:1"], now=2) == {A: 48}  # memory: all of it
    assert index.stored_tokens(Prefix(PROMPT), A, 48) == 16
    # Whole, but for the block of the last token, which an engine computes again.
    assert index.stored_tokens(Prefix(other), A, 48) == 32
    unsized = KvIndex(ttl_s=100, capacity=1000)  # a worker that reports no size
    unsized.assume(A, Prefix(PROMPT), now=0)
    assert unsized.stored_tokens(Prefix(PROMPT), A, 48) == 48


def test_a_large_slot_is_cleared_at_once_for_lookups_and_unheld_step_by_step() -> None:
    # 3,000 blocks on A (one chain), the first 16 also on B: clearing A is immediate for
    # lookups and the caps, while its keys lose A's bit a PURGE_STEP at a time.
    index = KvIndex()
    tokens = list(range(16 * 3000))
    index.store(A, stored(tokens, 1), None)
    index.store(B, stored(tokens[:16], 900_000), None)
    a_id = index._slots[A].id
    index.clear(A)
    assert index.matched_tokens(Prefix(tokens[:48]), ["a:1", "b:1"], 0) == {B: 16}
    assert (index.size("a:1"), index.total()) == (0, 1)
    assert index.purging and a_id not in index._holders.free  # its bit is not reusable yet
    steps = 2  # matched_tokens took one step already, the loop's last one ends it
    while index.purge():
        steps += 1
    assert steps == -(-3000 // PURGE_STEP)
    assert a_id in index._holders.free
    assert len(index._holders) == 1  # only B's block is held
    # A new slot may take the freed id: it inherits nothing.
    index.store(("c:1", 0), stored(tokens[16:32], 5), None)
    assert index.matched_tokens(Prefix(tokens[:48]), ["c:1", "a:1"], 0) == {}
    assert index.matched_tokens(Prefix(tokens[:48]), ["b:1"], 0) == {B: 16}
