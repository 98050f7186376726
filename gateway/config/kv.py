"""`kv:`: cache-aware placement and the KV index fed by workers' events."""

from __future__ import annotations

from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Flag, Interval, Number, Seconds


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
    where a prompt was placed is remembered for `pending_ttl_s` beside what the events say
    (also after the worker evicted it: sending it back keeps affinity, which measured
    better than moving it). A worker not ready for `grace_s` loses its entries."""

    events: Flag = True
    block_size: AtLeastOne = 16
    prefill_cost_per_token: Number = 0.01
    balance_ratio: Number = 1.5
    balance_slack: Number = 4.0
    share_window_s: Interval = 10.0  # shares decay by exp(-age / share_window_s)
    assume_ttl_s: Seconds = 120.0
    assume_capacity: AtLeastOne = 100_000
    pending_ttl_s: Seconds = 120.0
    grace_s: Seconds = 10.0
    # Worker input is untrusted (see "Limits and security"): per worker at most
    # `max_ranks` DP ranks and `max_block_sizes` distinct block sizes are indexed (the
    # excess is refused, logged once); stored blocks are capped per worker and in all
    # (the worker's oldest entries go first); one KV event message may be at most
    # `max_event_bytes` (a bigger one is refused and the subscription starts again);
    # subscriptions that keep failing start again after up to `resubscribe_max_s`.
    max_ranks: AtLeastOne = 256
    max_block_sizes: AtLeastOne = 4
    max_blocks_per_worker: AtLeastOne = 250_000
    max_blocks: AtLeastOne = 2_000_000
    max_event_bytes: AtLeastOne = 4 * 1024 * 1024
    resubscribe_max_s: Seconds = 8.0
