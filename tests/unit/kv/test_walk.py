"""The lookup's walk against a plain one: for chains held from the root (engines evict
from the tail), every slot's depth is exact at any prompt length, and the lookups stay
within a stride of head, the sampled depths and a stride per holder."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.kv.walk import stride_for, walk


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
    stride = stride_for(blocks)
    held = sum(1 for depth in depths if depth > 0)
    assert len(looked) <= stride + blocks // stride + held * stride


def test_the_stride_grows_with_the_prompt() -> None:
    assert stride_for(1) == stride_for(128) == 8
    assert stride_for(132) == 8  # the benchmark's median prompt: ~40 lookups, not ~100
    assert stride_for(2000) == 31
    assert all(stride_for(n) <= stride_for(n + 1) for n in range(5000))
