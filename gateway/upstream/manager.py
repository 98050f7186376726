"""The fleet: turns worker specs into registered workers and keeps their signals current.

`add` and `remove` are the one door through which workers enter and leave their cluster
(start-up's configured workers and the admin API both come through it); leaving drains
the worker's in-flight calls first. The fleet owns each worker's channel: the worker
itself (the host) holds only its signals.

Per worker it runs three loops: connection watching (unroutable the moment the channel
drops), active probes, and load polling (and, with KV events, a follower); the loops are
in their own modules (loops.py: probes and loads), as is what a joining worker is asked
(identify.py). Outlier
detection is fed by dispatch through `record_outcome`. Every status change is logged once,
with its cause.

Every task and timer the fleet starts for a worker is cancelled when the worker is
removed, and every one of them when the fleet closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
import structlog
from grpc import aio

from gateway.config import GatewayConfig, WorkerSpec
from gateway.core.roles import Role
from gateway.core.tasks import TaskScope, cancel_and_wait
from gateway.engines import Adapters
from gateway.kv.index import KvIndex
from gateway.security.tls import channel_credentials
from gateway.upstream import stagger
from gateway.upstream.channels import open_channel
from gateway.upstream.cluster import ClusterMaker, PolicyBuilder, PolicyContext
from gateway.upstream.health.active import ProbeLoop
from gateway.upstream.health.connection import watch_connection
from gateway.upstream.identify import DiscoveryError, discover
from gateway.upstream.load.kv_events import KvFollower
from gateway.upstream.load.lora import AdapterWatch
from gateway.upstream.loops import load_loop, probe_loop
from gateway.upstream.registry import FleetEvent, Registry
from gateway.upstream.signals.outlier import Outcome, OutlierDetector, OutlierState
from gateway.upstream.worker import Worker, WorkerStatus

log = structlog.get_logger("gateway.upstream")

DISCOVERY_RETRY_S = 1.0


class WorkerExists(ValueError):
    pass


class Fleet:
    """Owns worker channels and the background tasks that keep their status current.
    `adapters`: the engine protocols, for discovery, probes, load polls and KV events;
    `build_policy`: makes each cluster's policy (placement's, handed in by the assembly)."""

    def __init__(
        self, settings: GatewayConfig, adapters: Adapters, build_policy: PolicyBuilder
    ) -> None:
        self.settings = settings
        self.adapters = adapters
        self.kv_index = KvIndex.from_config(settings.kv)
        self.lora_watch = AdapterWatch.of(settings.lora)  # poll workers' LoRA adapters?
        # With flow control, a worker without a fresh load report waits out its load
        # limits (max_waiting, max_token_usage) instead of being taken as idle.
        context = PolicyContext(self.kv_index, settings.kv, settings.loads.stale_after_s)
        self._clusters = ClusterMaker(
            lambda model: self.settings.model(model),
            build_policy,
            context,
            stale_saturates=settings.flow is not None,
        )
        self.registry = Registry(self._clusters)
        self.registry.subscribe(self._log_event)
        self._channels: dict[Worker, aio.Channel] = {}
        # Each worker's callables, one per method path and shape: grpc builds a new one
        # each time it is asked, and every call would ask.
        self._methods: dict[Worker, dict[tuple[str, bool], Any]] = {}
        self.followers: dict[str, KvFollower] = {}
        self.registry.subscribe(self._forget_cache)
        self.registry.subscribe(self._watch_outliers)
        # A request's slot on a worker came free, or its load was reported again: told
        # by the registry itself (the fleet's own listeners hear it, never the fleet's
        # code in between).
        self.released: Callable[[Worker], None] = self.registry.capacity
        self._scope = TaskScope()  # every task the fleet starts; `close` ends them all
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}  # by worker, for `remove`
        self._timers: dict[str, set[asyncio.TimerHandle]] = {}
        self._credentials: grpc.ChannelCredentials | None = None

    def configure(self, settings: GatewayConfig) -> list[str]:
        """A reload: every cluster brought to its model's settings now (limits, policy),
        and the adapters LoRA polls look for. The models whose policy changed."""
        self.settings = settings
        self.lora_watch.configure(settings.lora)
        changed = [c.key.model for c in self.registry.every_cluster() if self._clusters.refresh(c)]
        return sorted(set(changed))

    async def start(self, specs: Iterable[WorkerSpec], source: str = "static") -> None:
        """Register every worker; waits (bounded) for discovery and a first connection
        outcome, so requests that arrive right after start-up are routed, not refused."""
        joins = [self._claim(spec, (source,)) for spec in specs]
        if joins:
            await asyncio.wait(joins, timeout=self.settings.discovery_timeout_s)

    def has(self, address: str) -> bool:
        """Registered, or joining (asking the worker what it is)."""
        registry = self.registry
        return registry.being_identified(address) or registry.get(address) is not None

    async def add(self, spec: WorkerSpec, source: str = "admin") -> Worker:
        """Register a worker at run time; returns once it is registered (not yet ready)."""
        if self.has(spec.address):
            raise WorkerExists(f"worker {spec.address} is already registered")
        await self._claim(spec, (source,), wait_settled=False)
        worker = self.registry.get(spec.address)
        assert worker is not None
        return worker

    def join(self, spec: WorkerSpec, sources: tuple[str, ...]) -> asyncio.Task[None]:
        """Start registering a discovered worker (the caller checked `has` first); the task
        ends once it has a first connection outcome and probe verdict."""
        return self._claim(spec, sources)

    def name(self, worker: Worker, sources: tuple[str, ...]) -> None:
        """The sources that list a registered worker now."""
        worker.named_by(sources)

    def set_in_service(self, worker: Worker, in_service: bool, cause: str) -> None:
        """What the worker's discovery source says of it (out of service: no new calls)."""
        worker.set_in_service(in_service, cause)

    async def drain(self, worker: Worker, timeout_s: float) -> bool:
        """No new requests; wait (bounded) until in-flight ones finish. True if it emptied."""
        idle = worker.begin_drain()
        if idle is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await idle.wait()
        return worker.inflight == 0

    def resume(self, worker: Worker) -> bool:
        """Undo a drain; False if the worker is being removed (its drain is its way out)."""
        if worker.removing:
            return False
        if worker.draining:
            worker.end_drain()
        return True

    async def remove(self, worker: Worker, drain_timeout_s: float) -> bool:
        """Drain, then forget the worker: its loops and timers stopped, its channel closed."""
        worker.removing = True
        emptied = await self.drain(worker, drain_timeout_s)
        self.registry.remove(worker)
        self.followers.pop(worker.id, None)
        self.kv_index.drop_worker(worker.id)
        for timer in self._timers.pop(worker.id, ()):
            timer.cancel()
        await cancel_and_wait(self._tasks.pop(worker.id, ()))
        self._methods.pop(worker, None)
        channel = self._channels.pop(worker, None)
        if channel is not None:
            await channel.close()
        return emptied

    async def close(self) -> None:
        for timers in self._timers.values():
            for timer in timers:
                timer.cancel()
        self._timers.clear()
        for worker in self.registry:
            worker.outlier.close()
        await self._scope.close()
        channels, self._channels = self._channels, {}
        self._methods.clear()
        for channel in channels.values():
            await channel.close()

    def method(self, worker: Worker, path: str, *, streaming: bool) -> Any:
        """The callable for `path` on the worker's channel, for calls on a client's behalf
        (the worker must be registered; a removed worker's channel is closed). Paths are
        the engines' own methods: a few per worker."""
        methods = self._methods.get(worker)
        if methods is None:
            methods = self._methods[worker] = {}
        found = methods.get((path, streaming))
        if found is None:
            channel = self._channels[worker]
            found = channel.unary_stream(path) if streaming else channel.unary_unary(path)
            methods[(path, streaming)] = found
        return found

    def record_outcome(self, worker: Worker, outcome: Outcome, *, trial: bool) -> None:
        """Dispatch reports how a request ended; feeds the worker's outlier detection."""
        worker.outlier.record(outcome, time.monotonic(), trial=trial)

    def on_dispatch(self, worker: Worker) -> bool:
        """A request was placed on the worker; returns whether it is the half-open trial."""
        outlier = worker.outlier
        outlier.on_dispatch(time.monotonic())
        return outlier.trial_in_flight

    def _watch_outliers(self, event: FleetEvent) -> None:
        """A worker's outlier detector tells the fleet its changes while it is in it."""
        if event.kind == "added":
            event.worker.outlier.watch(functools.partial(self._outlier_changed, event.worker))
        elif event.kind == "removed":
            event.worker.outlier.close()

    def _outlier_changed(
        self, worker: Worker, old: OutlierState, new: OutlierState, cause: str
    ) -> None:
        self.registry.publish(FleetEvent("outlier", worker, old.value, new.value, cause))

    def _later(
        self,
        worker: Worker,
        delay_s: float,
        callback: Callable[[FleetEvent], None],
        event: FleetEvent,
    ) -> None:
        """`callback(event)` after `delay_s`, while the worker stays registered: the timer
        is cancelled when the worker is removed or the fleet closes."""
        if self.registry.get(worker.id) is not worker:
            return  # removed already (a request that ended after the removal)
        timers = self._timers.setdefault(worker.id, set())

        def fire() -> None:
            timers.discard(handle)
            callback(event)

        handle = asyncio.get_running_loop().call_later(delay_s, fire)
        timers.add(handle)

    def upstream_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for grpcs:// workers, read once (a bad file fails at start-up)."""
        if self._credentials is None:
            self._credentials = channel_credentials(self.settings.upstream_tls)
        return self._credentials

    def _claim(
        self, spec: WorkerSpec, sources: tuple[str, ...], wait_settled: bool = True
    ) -> asyncio.Task[None]:
        """Start joining a worker; its address counts as taken from this moment, before
        anything awaits, so two concurrent adds cannot both register it."""
        self.registry.identifying(spec, sources, time.monotonic())
        join = self._join(spec, sources, wait_settled)
        return self._own(spec.address, self._scope.spawn(join, "join", worker=spec.address))

    def _own(self, key: str, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """Index one of the fleet's tasks by its worker's address, until it ends: what
        `remove` cancels."""
        tasks = self._tasks.setdefault(key, set())
        tasks.add(task)

        def forget(done: asyncio.Task[None]) -> None:
            tasks.discard(done)
            if not tasks and self._tasks.get(key) is tasks:
                del self._tasks[key]  # a join given up (a host dropped before it answered)

        task.add_done_callback(forget)
        return task

    def _keep(self, worker: Worker, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run one of a worker's background loops for as long as the worker is registered:
        supervised (an exception is logged once while it repeats; the loop starts again)."""
        self._own(worker.id, self._scope.supervise(name, run, worker=worker.id))

    async def _join(
        self, spec: WorkerSpec, sources: tuple[str, ...], wait_settled: bool = True
    ) -> None:
        """Discover what the spec leaves open (retrying until the worker answers), then
        register the worker and start its loops."""
        try:  # hundreds joining at once spread over up to a second
            await asyncio.sleep(stagger.spread(self.registry.identifying_count))
        except asyncio.CancelledError:
            self.registry.identified(spec.address)
            raise
        channel = open_channel(
            spec.address,
            self.settings.max_message_bytes,
            self.settings.upstream,
            self.upstream_credentials() if spec.tls else None,
        )
        call_timeout = min(2.0, self.settings.discovery_timeout_s)
        warned = False
        try:
            while True:
                try:
                    found = await discover(spec, channel, self.adapters, call_timeout)
                    runtime, model, facts, vocab_size = found
                    break
                except DiscoveryError as exc:
                    self.registry.unanswered(spec.address, str(exc))
                    if not warned:
                        log.warning("discovery_failed", worker=spec.address, error=str(exc))
                        warned = True
                    await asyncio.sleep(DISCOVERY_RETRY_S)
        except asyncio.CancelledError:
            await channel.close()
            raise
        finally:
            self.registry.identified(spec.address)
        worker = Worker(
            spec=spec,
            model=model,
            runtime=runtime,
            outlier=OutlierDetector(self.settings.outlier_detection),
            sources=sources,
            role=spec.role or facts.role or Role.REGULAR,
            bootstrap_port=spec.bootstrap_port or facts.bootstrap_port,
            pairing=facts.pairing,
            block_size=facts.block_size,
            vocab_size=vocab_size,
            window=facts.window,
        )
        self._channels[worker] = channel
        self.registry.add(worker)
        adapter = self.adapters[runtime]
        prober = ProbeLoop(worker, channel, adapter, self.settings.probe)
        settled, probed = asyncio.Event(), asyncio.Event()
        self._keep(
            worker,
            "connection",
            lambda: watch_connection(worker, channel, settled, prober.wake),
        )
        self._keep(worker, "probe", lambda: probe_loop(worker, prober, probed, self.settings.probe))
        if worker.role is not Role.ENCODE:  # encoders report no loads, cache no prompts
            loads, watch = self.settings.loads, self.lora_watch
            self._keep(
                worker,
                "loads",
                lambda: load_loop(worker, channel, adapter, loads, watch, self.released),
            )
            if self.settings.kv.events:
                follower = KvFollower(
                    worker,
                    adapter,
                    self.kv_index,
                    settings=self.settings.kv,
                    connect=self._kv_channel(worker),
                    on_report=functools.partial(self.released, worker),
                )
                self.followers[worker.id] = follower
                self._keep(worker, "kv_events", follower.run)
        if wait_settled:  # bounded by start()'s timeout
            # The first connection outcome and the first probe's verdict: a process that
            # listens right after start-up (or after a restart) routes instead of refusing.
            await settled.wait()
            await probed.wait()

    def _kv_channel(self, worker: Worker) -> Callable[[int], aio.Channel]:
        """How a worker's KV-event subscription opens its own channel: the worker's
        channel settings and credentials, with its own receive limit."""
        credentials = self.upstream_credentials() if worker.spec.tls else None

        def connect(max_receive_bytes: int) -> aio.Channel:
            address, upstream = worker.spec.address, self.settings.upstream
            return open_channel(address, max_receive_bytes, upstream, credentials)

        return connect

    def _forget_cache(self, event: FleetEvent) -> None:
        """A worker not ready for `kv.grace_s` loses its index entries: whatever comes
        back may have lost its cache (a restart), and its events start over anyway."""
        if event.kind != "status" or event.old != WorkerStatus.READY.value:
            return
        self._later(event.worker, self.settings.kv.grace_s, self._drop_if_unready, event)

    def _drop_if_unready(self, event: FleetEvent) -> None:
        worker = event.worker
        if self.registry.get(worker.id) is worker and worker.status is not WorkerStatus.READY:
            self.kv_index.drop_worker(worker.id)

    def _log_event(self, event: FleetEvent) -> None:
        worker = event.worker
        if event.kind == "added":
            log.info(
                "worker_registered",
                worker=worker.id,
                model=worker.model,
                runtime=worker.runtime.value,
                role=worker.role.value,
            )
        elif event.kind == "removed":
            log.info("worker_removed", worker=worker.id, model=worker.model)
        elif event.old != event.new:
            # A host leaving service is a warning (what an alert fires on); its return, a
            # drain (the operator's own doing) and the rest are info.
            leaving = (event.kind, event.new) in LEAVING
            (log.warning if leaving else log.info)(
                f"worker_{event.kind}",
                worker=worker.id,
                old=event.old,
                new=event.new,
                cause=event.cause,
            )


# (event kind, new state) of a worker that stops taking calls without being asked to.
LEAVING = frozenset(
    {("status", WorkerStatus.NOT_READY.value), ("outlier", OutlierState.OPEN.value)}
)
