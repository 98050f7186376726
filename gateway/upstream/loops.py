"""Two of a registered worker's background loops, which the fleet keeps running while the
worker is registered: its probes' results into its signals, and its load polls (its
vocabulary until it answers, its LoRA adapters when they are watched).

The other two live beside what they follow: connection watching in health/connection.py,
KV events in load/kv_events.py. Each loop runs until cancelled; the fleet supervises it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from grpc import aio

from gateway.config import LoadsConfig, ProbeConfig
from gateway.engines import EngineAdapter
from gateway.upstream import stagger
from gateway.upstream.health.active import ProbeLoop
from gateway.upstream.identify import vocabulary
from gateway.upstream.load.lora import AdapterWatch, poll_loras
from gateway.upstream.load.poller import poll_load
from gateway.upstream.worker import Worker

log = structlog.get_logger("gateway.upstream")


async def probe_loop(
    worker: Worker, prober: ProbeLoop, probed: asyncio.Event, settings: ProbeConfig
) -> None:
    """Every probe's result into the worker's signals; `probed` is set after the first."""
    result = await prober.probe()
    while True:
        worker.probed(result, settings)
        probed.set()
        result = await prober.next_result()


async def load_loop(
    worker: Worker,
    channel: aio.Channel,
    adapter: EngineAdapter,
    settings: LoadsConfig,
    lora_watch: AdapterWatch,
    released: Callable[[Worker], None],
) -> None:
    """Poll the worker's load at a staggered interval; `released(worker)` after each poll
    (a fresh report may leave room). A poll that starts or stops failing is logged once."""
    failing = False
    waits = stagger.waits(settings.interval_s)  # workers that joined together spread
    while True:
        if worker.vocab_size is None:
            worker.vocab_size = await vocabulary(channel, adapter, settings.timeout_s)
        await poll_load(worker, channel, adapter, settings)
        if lora_watch.polls(adapter):
            await poll_loras(worker, channel, adapter, settings.timeout_s, lora_watch)
        released(worker)  # a fresh report may leave room: whoever waits hears it
        if (worker.load_error is not None) != failing:
            failing = not failing
            log.warning(
                "load_poll_failing" if failing else "load_poll_recovered",
                worker=worker.id,
                error=worker.load_error,
            )
        await asyncio.sleep(next(waits))
