"""Loading a call's LoRA adapter on its workers before the call is sent there.

Placement sent the call where the adapter is held, or has room, or holds one it may
unload (placement/lora.py); here, before the attempt opens any leg, each of its engine
workers that does not hold the adapter loads it (LoadLoRAAdapter with the path in
`lora.adapters`), first unloading the least recently used adapter no running call uses
when the worker is at `lora.max_loaded_per_worker`. One load per (worker, adapter) at a
time: calls that need the same one wait for it (a shared future, which no one caller's
cancel cancels), all bounded by `lora.load_timeout_s`. A failed load fails the attempt
on that worker only (`LoadFailed`): dispatch tries another. A load that timed out counts
as a failure in the worker's outlier detection, and the adapter is not tried on that
worker again for a while (`load_backoff_s`, growing with each timeout in a row): a
worker that hangs loads costs calls one timeout each, not one per call.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError
from grpc import aio

from gateway.config.lora import LoraConfig
from gateway.core.roles import Role
from gateway.core.tasks import TaskScope
from gateway.engines import EngineAdapter
from gateway.placement.lora import Holding, adapter_of, evictable, has_room
from gateway.proxy.job import Job
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.upstream import Links
from gateway.upstream.load.lora import FAILED, LOADED
from gateway.upstream.signals.outlier import Outcome
from gateway.upstream.worker import Worker

LOAD_RPC, UNLOAD_RPC = "LoadLoRAAdapter", "UnloadLoRAAdapter"
MAX_LOAD_BACKOFF_S = 600.0  # the longest a (worker, adapter) load waits after timeouts

Key = tuple[str, str]  # (worker id, adapter)


def load_backoff_s(timeouts: int, timeout_s: float) -> float:
    """How long a (worker, adapter) load is not tried again after `timeouts` in a row:
    one load timeout, doubling, at most MAX_LOAD_BACKOFF_S."""
    return min(timeout_s * 2.0 ** min(timeouts - 1, 16), MAX_LOAD_BACKOFF_S)


class LoadFailed(Exception):
    """The adapter could not be loaded on `worker` (`why`: what it or the call said)."""

    def __init__(self, worker: Worker, adapter: str, why: str) -> None:
        super().__init__(why)
        self.worker, self.adapter, self.why = worker, adapter, why


class Using:
    """A call's use of its adapter on its workers, counted from before the load until the
    attempt ends (so no eviction takes it from under the call)."""

    __slots__ = ("_adapter", "_workers")

    def __init__(self, workers: Sequence[Worker], adapter: str) -> None:
        self._workers, self._adapter = workers, adapter
        for worker in workers:
            worker.lora_used(adapter)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        for worker in self._workers:
            worker.lora_freed(self._adapter)


class NotUsing:
    """A call that names no adapter the gateway manages."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


NOT_USING = NotUsing()


class LoraLoader:
    """Loads adapters on demand; counts loads (by model and outcome) and evictions (by
    model) for the metrics, read at scrape time."""

    def __init__(self, config: LoraConfig, links: Links) -> None:
        self._config = config  # replaced whole by `configure` (a reload)
        self._links = links
        self._pending: dict[Key, asyncio.Task[None]] = {}
        self._loading = TaskScope(log_failures=False)  # a failure is its waiters' answer
        # Loads that timed out: their timeouts in a row, and until when not tried again.
        # At most one per (worker, configured adapter); a success ends its row, and one
        # past MAX_LOAD_BACKOFF_S ago goes as another is added.
        self.timed_out: dict[Key, tuple[int, float]] = {}
        self.loads: Counter[tuple[str, str]] = Counter()
        self.evictions: Counter[str] = Counter()

    def configure(self, config: LoraConfig) -> None:
        """A reload: the adapters, their bound per worker and the load timeout, from the
        next call on (loads under way finish as they started)."""
        self._config = config

    def _managed(self, job: Job) -> str:
        """The adapter the job's call names, if the gateway loads it ("" otherwise)."""
        info = job.call.info
        config = self._config
        if info is None or not config.load_on_demand or LOAD_RPC not in job.adapter.rpcs:
            return ""
        adapter = adapter_of(info.namespace)
        return adapter if adapter in config.adapters else ""

    async def prepare(self, job: Job, reserved: ReservedPlacement) -> Using | NotUsing:
        """The adapter loaded on every engine worker of the attempt; raises LoadFailed.
        The use is counted at once (before any await), so placement's next call sees it."""
        adapter = self._managed(job)
        if not adapter:
            return NOT_USING
        workers = [w for w in reserved.decision.workers.values() if w.role is not Role.ENCODE]
        using = Using(workers, adapter)
        try:
            for worker in workers:
                if adapter not in worker.loras:
                    self._check_backoff(worker, adapter)
                    await self._shared_load(worker, adapter, job.adapter)
        except BaseException:
            using.__exit__()
            raise
        return using

    def _check_backoff(self, worker: Worker, adapter: str) -> None:
        """Raise LoadFailed at once while the adapter's last load there timed out lately."""
        found = self.timed_out.get((worker.id, adapter))
        if found is not None and (left := found[1] - time.monotonic()) > 0:
            raise LoadFailed(
                worker, adapter, f"its last load timed out: tried again in {left:.0f} s"
            )

    def _timed_out(self, worker: Worker, adapter: str) -> None:
        """A load timed out: the adapter waits there, longer each time; the worker's
        outlier detection counts a failure (once per load, not per waiting call)."""
        now = time.monotonic()
        recent = now - MAX_LOAD_BACKOFF_S  # older ones start afresh (a worker long gone)
        self.timed_out = {k: v for k, v in self.timed_out.items() if v[1] > recent}
        key = (worker.id, adapter)
        timeouts = self.timed_out.get(key, (0, 0.0))[0] + 1
        wait = load_backoff_s(timeouts, self._config.load_timeout_s)
        self.timed_out[key] = (timeouts, now + wait)
        self._links.record_outcome(worker, Outcome.FAILURE, trial=False)

    async def _shared_load(self, worker: Worker, adapter: str, engine: EngineAdapter) -> None:
        key = (worker.id, adapter)
        task = self._pending.get(key)
        if task is None:
            task = self._loading.spawn(
                self._load(worker, adapter, engine), "lora_load", worker=worker.id
            )
            self._pending[key] = task
            task.add_done_callback(lambda done: self._loaded(key, done))
        await asyncio.shield(task)

    async def close(self) -> None:
        """Cancel the loads still running (the gateway is stopping)."""
        await self._loading.close()

    def _loaded(self, key: Key, done: asyncio.Task[None]) -> None:
        self._pending.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: its waiters, if any, have it too

    async def _load(self, worker: Worker, adapter: str, engine: EngineAdapter) -> None:
        timeout = self._config.load_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await self._make_room(worker, adapter, engine)
                await self._call_load(worker, adapter, engine)
        except LoadFailed:
            self.loads[(worker.model, FAILED)] += 1
            raise
        except TimeoutError:
            self.loads[(worker.model, FAILED)] += 1
            self._timed_out(worker, adapter)
            raise LoadFailed(worker, adapter, f"no answer in {timeout:g} s") from None
        self.loads[(worker.model, LOADED)] += 1
        self.timed_out.pop((worker.id, adapter), None)
        worker.lora_loaded(adapter)

    async def _make_room(self, worker: Worker, adapter: str, engine: EngineAdapter) -> None:
        """At the limit (adapters being loaded there count): unload the least recently used
        adapter no call uses, taken off the worker's list first so no call is sent for it
        meanwhile (a failed unload shows again at the next poll). If none can go, the load
        is tried anyway: the worker has the last word."""
        holding = Holding(worker.loras, worker.lora_calls)
        if has_room(holding, self._config.max_loaded_per_worker, adapter):
            return
        victim = evictable(holding, adapter)
        if victim is None:
            return
        worker.lora_unloaded(victim)
        reply = await self._call(worker, engine, UNLOAD_RPC, lora_id=victim)
        if reply is not None and reply.success:
            self.evictions[worker.model] += 1

    async def _call_load(self, worker: Worker, adapter: str, engine: EngineAdapter) -> None:
        path = self._config.adapters[adapter]
        reply = await self._call(
            worker, engine, LOAD_RPC, lora_id=adapter, lora_name=adapter, lora_path=path
        )
        if reply is None:
            raise LoadFailed(worker, adapter, "the load call failed")
        if not reply.success:
            raise LoadFailed(worker, adapter, reply.message or "the worker refused the load")

    async def _call(self, worker: Worker, engine: EngineAdapter, name: str, **fields: str) -> Any:
        """One admin call to the worker (each bounded by the load's timeout, as is the
        whole load); None when it failed on the wire."""
        spec = engine.rpcs[name]
        request = spec.request_type(**fields).SerializeToString()
        try:
            raw = await self._links.method(worker, spec.path, streaming=False)(
                request, timeout=self._config.load_timeout_s
            )
            return spec.response_type.FromString(raw)
        except (aio.AioRpcError, DecodeError):
            return None
