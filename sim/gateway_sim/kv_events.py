"""``SubscribeKvEvents`` of the simulated engines: the prefix caches' changes (one cache
per DP rank) published per rank and relayed as ``KvEventBatch`` streams, by one of the
two relays smg-grpc-servicer has (``--kv-relay``):

- ``python`` (default, ``relay_python``): its Python relay, live only;
- ``rust`` (``relay_rust``): its engine_servicer's Rust relay, with history, resume
  from a cursor and snapshots.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from grpc.aio import ServicerContext

from gateway_sim import relay_python, relay_rust
from gateway_sim.config import SimConfig
from gateway_sim.kv_log import LoadOf, RankLog, Subscription
from gateway_sim.prefix_cache import PrefixCache

# rank -> the servicer's load record for it (its GetLoads figures), None while unknown
LoadSource = Callable[[int], Any]


class KvEvents:
    """The engine's prefix caches (one per DP rank), their publishers and subscribers."""

    def __init__(self, config: SimConfig, load_of: LoadOf) -> None:
        self.enabled = config.kv_events
        self.config = config
        self.load_of = load_of  # the rust relay's record
        # The python relay's record: the servicer's own (see SharedRpcs.load_record).
        self.load_source: LoadSource | None = None
        self.disabled_message = "KV events are disabled"  # the servicer sets its engine's
        self._subscriptions: set[Subscription] = set()
        python = config.kv_relay == "python"
        clears = python and relay_python.PUBLISHERS[config.runtime].cleared_at_start
        seed = os.urandom(16)  # per process: subscribers cannot recompute our hashes
        self.logs = [
            RankLog(
                rank,
                0 if python else config.kv_history,
                config.block_size,
                self._subscriptions,
                config.kv_drop_rate,
                first=0 if python else 1,
                cleared_at_start=clears,
            )
            for rank in range(config.dp_ranks)
        ]
        self.caches = [
            PrefixCache(config.block_size, config.kv_blocks, seed, log if self.enabled else None)
            for log in self.logs
        ]

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    def subscribe(self, subscription: Subscription) -> None:
        self._subscriptions.add(subscription)

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)

    def flush(self) -> None:
        """FlushCache: every rank's cache cleared, a ``cleared`` batch on each."""
        for cache in self.caches:
            cache.flush()

    async def serve(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        """One SubscribeKvEvents call, by the configured relay."""
        if not self.enabled:
            await _abort(context, grpc.StatusCode.UNIMPLEMENTED, self.disabled_message)
        if self.config.kv_relay == "python":
            await relay_python.serve(self, request, context)
        else:
            await relay_rust.serve(self, request, context)


async def _abort(
    context: ServicerContext[Any, Any], code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable")
