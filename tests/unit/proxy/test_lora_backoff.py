"""How long a (worker, adapter) load waits after it timed out: one load timeout, doubling
with each timeout in a row, bounded."""

from __future__ import annotations

from gateway.proxy.lora import MAX_LOAD_BACKOFF_S, load_backoff_s


def test_the_wait_doubles_with_each_timeout_up_to_the_bound() -> None:
    assert [load_backoff_s(n, 30.0) for n in (1, 2, 3, 4)] == [30.0, 60.0, 120.0, 240.0]
    assert load_backoff_s(6, 30.0) == load_backoff_s(10**9, 30.0) == MAX_LOAD_BACKOFF_S
