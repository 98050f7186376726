"""Load polling: GetLoads per worker at an interval, for load-aware policies and overload.

A failed poll keeps the last report and records the error; the report then ages. Once
it is older than `stale_after_s` placement stops trusting it (see fleet/overload.py),
so a worker that cannot report its load is judged by what the gateway itself knows (its
own in-flight count), never by numbers that may be minutes old, and never as idle.
Figures out of range (NaN, infinite, negative, past LoadReport.MAX_REQUESTS) are ignored
and counted (`LoadReport.checked`).
"""

from __future__ import annotations

import time

from google.protobuf.message import DecodeError
from grpc import aio

from gateway.config import LoadsConfig
from gateway.engines import EngineAdapter
from gateway.upstream.signals.load import LoadReport
from gateway.upstream.worker import Worker


async def poll_load(
    worker: Worker, channel: aio.Channel, adapter: EngineAdapter, settings: LoadsConfig
) -> None:
    """One poll over the worker's engine protocol (`adapter`): updates `worker.load` or
    records `worker.load_error`."""
    try:
        raw = await channel.unary_unary(adapter.path("GetLoads"))(
            adapter.load_request(), timeout=settings.timeout_s
        )
        running, waiting, usage, kv_tokens = adapter.load_figures(raw)
    except aio.AioRpcError as error:
        worker.load_failed(f"{error.code().name}: {error.details()}")
        return
    except DecodeError as error:
        worker.load_failed(f"bad GetLoads answer: {error}")
        return
    # Worker numbers are untrusted: figures out of range keep the last report's.
    worker.reported(
        LoadReport.checked(
            running, waiting, usage, time.monotonic(), worker.inflight, worker.load, kv_tokens
        )
    )
