"""`kv:`: cache-aware placement and the KV index fed by workers' events."""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Flag, Interval, Number, Seconds, Size


@dataclass(frozen=True, slots=True, config=SETTINGS)
class KvConfig:
    """Cache-aware placement (policy `cache_aware`).

    cost(worker) = uncached prompt tokens x `prefill_cost_per_token` + load, where load is
    the gateway's own in-flight count on the worker plus what the worker last reported
    beyond it (KV event load record or GetLoads: other clients' requests). Balance guard:
    only workers whose load is at most `balance_ratio` x the least loaded candidate's +
    `balance_slack`, and whose share of the placements of the last `share_window_s` is at
    most `balance_ratio` x the mean share + 1, compete: affinity never piles requests on
    one worker. Workers without KV events are indexed from the gateway's own placements
    for `assume_ttl_s`, at most `assume_capacity` blocks each; on workers with events,
    where a prompt was placed is remembered for `pending_ttl_s` beside what the events say,
    up to 32 blocks past what they show stored (also after the worker evicted it: sending
    it back keeps affinity, which measured better than moving it). A worker not ready for
    `grace_s` loses its entries."""

    events: Flag = Field(
        default=True,
        description="follow every worker's `SubscribeKvEvents` into the prefix index",
    )
    block_size: AtLeastOne = Field(
        default=16, description="block size for workers that report none"
    )
    prefill_cost_per_token: Number = Field(
        default=0.01, description="weight of one uncached prompt token against one queued call"
    )
    balance_ratio: Number = Field(
        default=1.5,
        description="balance guard: load and share at most this times the least / mean",
    )
    balance_slack: Number = Field(default=4.0, description="balance guard: plus this much load")
    # shares decay by exp(-age / share_window_s)
    share_window_s: Interval = Field(
        default=10.0, description="placement shares decay over this window"
    )
    assume_ttl_s: Seconds = Field(
        default=120.0,
        description="workers without KV events: a placement assumed cached this long",
    )
    assume_capacity: AtLeastOne = Field(
        default=100_000, description="... at most this many blocks a worker"
    )
    pending_ttl_s: Seconds = Field(
        default=120.0,
        description=(
            "workers with KV events: a placement remembered this long (up to 32 blocks"
            " past what the events show stored)"
        ),
    )
    grace_s: Seconds = Field(
        default=10.0, description="a worker not ready this long loses its index entries"
    )
    # Worker input is untrusted (see "Limits and security"): per worker at most
    # `max_ranks` DP ranks and `max_block_sizes` distinct block sizes are indexed (the
    # excess is refused, logged once); stored blocks are capped per worker and in all
    # (the worker's oldest entries go first); one KV event message may be at most
    # `max_event_bytes` (a bigger one is refused and the subscription starts again);
    # subscriptions that keep failing start again after up to `resubscribe_max_s`.
    max_ranks: AtLeastOne = Field(default=256, description="data-parallel ranks indexed per worker")
    max_block_sizes: AtLeastOne = Field(
        default=4, description="distinct block sizes indexed per worker"
    )
    max_blocks_per_worker: AtLeastOne = Field(
        default=250_000, description="stored blocks indexed per worker (~200 bytes each)"
    )
    max_blocks: AtLeastOne = Field(
        default=2_000_000, description="stored blocks indexed in all: the index's memory bound"
    )
    max_event_bytes: Size = Field(
        default=4 * 1024 * 1024,
        description="largest KV event message; a bigger one restarts the subscription",
    )
    resubscribe_max_s: Seconds = Field(
        default=8.0, description="a failing subscription's backoff grows to this"
    )
