"""The lookup's walk against a plain one: for chains held from the root (engines evict
from the tail), every slot's depth is exact at any prompt length, and the reads stay
within a bisection per group of slots at one depth, never more than the blocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.kv.walk import walk


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.integers(min_value=1, max_value=700),
    depths=st.lists(st.integers(min_value=0, max_value=700), min_size=1, max_size=6),
)
def test_depths_are_exact_for_chains_held_from_the_root(blocks: int, depths: list[int]) -> None:
    keys = list(range(1000, 1000 + blocks))
    holders = {
        key: sum(1 << slot for slot, depth in enumerate(depths) if n < depth)
        for n, key in enumerate(keys)
    }
    looked: list[int] = []

    def get(key: int) -> int:
        looked.append(key)
        return holders.get(key, 0)

    mask = (1 << len(depths)) - 1
    found = dict(walk(get, keys, mask))
    expected = {slot: min(depth, blocks) for slot, depth in enumerate(depths) if depth > 0}
    assert found == expected
    groups = len(set(expected.values()))
    assert len(looked) <= min(blocks, 1 + groups * blocks.bit_length())
    assert len(set(looked)) == len(looked)  # no block read twice


def test_the_median_benchmark_prompt_costs_a_few_reads() -> None:
    keys = list(range(132))  # bench_policy's median prompt, held to block 100 by one slot
    looked: list[int] = []

    def get(key: int) -> int:
        looked.append(key)
        return 1 if key < 100 else 0

    assert list(walk(get, keys, 1)) == [(0, 100)]
    assert len(looked) <= 9  # the strided walk this replaced read 30


def test_slots_outside_the_mask_or_without_the_root_are_not_found() -> None:
    keys = list(range(10))
    masks = {0: 0b01, **{k: 0b11 for k in range(1, 10)}}  # slot 1 lacks the root
    assert dict(walk(lambda k: masks.get(k, 0), keys, 0b11)) == {0: 10}
    assert dict(walk(lambda k: masks.get(k, 0), keys, 0b10)) == {}
    assert list(walk(lambda k: 0b1, [], 0b1)) == []


@settings(max_examples=200, deadline=None)
@given(masks=st.lists(st.integers(min_value=0, max_value=0b1111), min_size=1, max_size=200))
def test_any_holdings_end_at_a_real_edge_within_the_blocks_reads(masks: list[int]) -> None:
    """Whatever a worker's events make of its chains (holes anywhere), the walk ends: at
    most one read a block, each depth an edge of what the slot holds (its block before
    held, its block at the depth not, or the prompt's end), every slot of the root's
    mask found once."""
    blocks = len(masks)
    keys = list(range(blocks))
    looked: list[int] = []

    def get(key: int) -> int:
        looked.append(key)
        return masks[key]

    found = list(walk(get, keys, 0b1111))
    assert len(looked) <= blocks and len(set(looked)) == len(looked)
    slots = [slot for slot, _ in found]
    assert sorted(slots) == [s for s in range(4) if masks[0] >> s & 1]
    for slot, depth in found:
        assert 1 <= depth <= blocks
        assert masks[depth - 1] >> slot & 1
        assert depth == blocks or not masks[depth] >> slot & 1
