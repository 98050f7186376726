"""The fleet: turns configured worker specs into registered, watched workers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterable
from typing import Any

import structlog
from grpc import aio

from gateway.config import WorkerSpec
from gateway.fleet.channels import open_channel
from gateway.fleet.connection import watch_connection
from gateway.fleet.discovery import DiscoveryError, detect_runtime, served_model
from gateway.fleet.registry import Registry
from gateway.fleet.worker import Worker

log = structlog.get_logger("gateway.fleet")

DISCOVERY_RETRY_S = 1.0


class Fleet:
    """Owns worker channels and the background tasks that keep their status current."""

    def __init__(self, max_message_bytes: int, discovery_timeout_s: float) -> None:
        self.registry = Registry()
        self._max_message_bytes = max_message_bytes
        self._discovery_timeout_s = discovery_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._channels: list[aio.Channel] = []
        self.registry.subscribe(self._log_status)
        self._last_status: dict[str, str] = {}

    async def start(self, specs: Iterable[WorkerSpec]) -> None:
        """Register every worker; waits (bounded) for discovery and a first connection
        outcome, so requests that arrive right after start-up are routed, not refused."""
        pending = [self._spawn(self._join(spec)) for spec in specs]
        if pending:
            await asyncio.wait(pending, timeout=self._discovery_timeout_s)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for channel in self._channels:
            await channel.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _join(self, spec: WorkerSpec) -> None:
        """Discover what the spec leaves open (retrying until the worker answers), then watch."""
        channel = open_channel(spec.address, self._max_message_bytes)
        self._channels.append(channel)
        timeout = min(2.0, self._discovery_timeout_s)
        warned = False
        while True:
            try:
                runtime = spec.runtime or await detect_runtime(channel, timeout)
                model = spec.model or await served_model(channel, runtime, timeout)
                break
            except DiscoveryError as exc:
                if not warned:
                    log.warning("discovery_failed", worker=spec.address, error=str(exc))
                    warned = True
                await asyncio.sleep(DISCOVERY_RETRY_S)
        worker = Worker(spec=spec, model=model, runtime=runtime, channel=channel)
        self.registry.add(worker)
        log.info(
            "worker_registered",
            worker=worker.id,
            model=model,
            runtime=runtime.value,
            role=spec.role.value,
        )
        settled = asyncio.Event()
        self._spawn(watch_connection(worker, self.registry, settled))
        await settled.wait()  # bounded by start()'s timeout

    def _log_status(self, worker: Worker) -> None:
        old = self._last_status.get(worker.id)
        if old == worker.status.value:
            return
        self._last_status[worker.id] = worker.status.value
        if old is not None:
            log.info(
                "worker_status",
                worker=worker.id,
                old=old,
                new=worker.status.value,
                cause=worker.status_cause,
            )
