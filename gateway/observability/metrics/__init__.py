"""Prometheus metrics: per-call counters fed by dispatch, fleet gauges read at scrape time.

Per call, `observe` costs a few dict lookups: label children are cached, so the hot path
never re-validates labels. Fleet gauges cost nothing per request: a custom collector reads
the registry when Prometheus scrapes. The scrape runs in the HTTP server's thread, so the
collector only copies what it reads and never changes fleet state.

By subject: `calls` (the series fed by each call's record), `flow` (flow control's: by
class and tenant, and its queues), `fleet` (the workers' gauges), `kv` (the prefix index
and KV event streams), `counts` (counts kept elsewhere: spans, metadata not relayed),
`process` (the process's resources and build),
`exposition` (`Metrics`, which holds them all in one registry, and the /metrics endpoint).
"""

from gateway.observability.metrics.calls import TTFT_BUCKETS
from gateway.observability.metrics.exposition import Endpoint, Metrics
from gateway.observability.metrics.fleet import FleetCollector
from gateway.observability.metrics.flow import FLOW_OUTCOMES, flow_outcome

__all__ = [
    "FLOW_OUTCOMES",
    "TTFT_BUCKETS",
    "Endpoint",
    "FleetCollector",
    "Metrics",
    "flow_outcome",
]
