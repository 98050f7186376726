"""`gateway serve --processes N`: one supervisor, N serving processes on one port.

The supervisor holds the main port (SO_REUSEPORT: the kernel spreads connections over
the processes), starts the serving processes, restarts one that dies (with backoff) or
stops answering on its control socket (killed first), forwards signals, and is the one
control plane: the admin API (`ControlPlane`) and a /metrics that sums every process's
counters once. It serves no client call itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import shutil
import signal
import tempfile
import time
from pathlib import Path

import structlog
from grpc import aio
from prometheus_client import CollectorRegistry

from gateway.admin.service import serve_admin
from gateway.admin.v1 import admin_pb2_grpc
from gateway.app.assembly import preflight
from gateway.app.metrics import Endpoint
from gateway.app.reload import Reloader, Reread
from gateway.app.server import ready_line
from gateway.config import GatewayConfig
from gateway.config.reload import Reload
from gateway.core.listen import CannotListen
from gateway.core.tasks import TaskScope
from gateway.discovery.metrics import DiscoveryCollector
from gateway.observability.metrics.process import build_series, process_series
from gateway.scale.child import Launch
from gateway.scale.control import ControlPlane
from gateway.scale.desired import AdminStub, DesiredFleet, reconcile
from gateway.scale.member import Member, serving_config
from gateway.scale.merge import ProcessesCollector
from gateway.scale.port import hold_port
from gateway.scale.process import NotStarted, Position, answers, drain_output, start_process
from gateway.scale.relay import DiscoveryRelay

log = structlog.get_logger("gateway.supervisor")

STABLE_S = 10.0  # a process that ran this long is restarted at once; else backoff grows
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 10.0
# Liveness: every listening process is asked (ListWorkers on its control socket) every
# LIVENESS_INTERVAL_S, each check within LIVENESS_TIMEOUT_S (a missed check is followed
# by the next at once); LIVENESS_MISSES checks in a row without an answer (at least 4 s
# of silence: a GC pause is not a kill) and it is killed and restarted like one that
# died. A process wedged at T is killed by T + 5 s, and serving again ~1.5 s later.
LIVENESS_INTERVAL_S = 1.0
LIVENESS_TIMEOUT_S = 2.0
LIVENESS_MISSES = 2


class Supervisor:
    def __init__(
        self, config: GatewayConfig, reread: Reread | None = None, watch: str | None = None
    ) -> None:
        self.config = config  # the config in force: a reload replaces its keys that reload
        # SIGHUP (`watch`: and a change of that file) reads the config again here; each
        # serving process then reads its own share of it from its launch file.
        self.reloader = Reloader(lambda: self.config, reread, self._reloaded)
        self._watched = watch
        self.count = config.processes
        self.desired = DesiredFleet.of(config)
        self.relay = DiscoveryRelay(config.discovery, self._channels) if config.discovery else None
        self.positions = [Position(i) for i in range(self.count)]
        self.stopping = False
        self.signals: list[signal.Signals] = []
        self._stop = asyncio.Event()
        self._dir = ""
        self._endpoint: Endpoint | None = None  # the metrics endpoint, once started
        self.port = 0
        self.picker_port = 0
        self._tasks = TaskScope()  # per process: its keeper, liveness check, output drain
        self.liveness_interval_s = LIVENESS_INTERVAL_S
        self.liveness_timeout_s = LIVENESS_TIMEOUT_S
        self.liveness_misses = LIVENESS_MISSES

    def member(self, index: int) -> Member:
        return Member(index, self.count, self._dir)

    def reachable(self) -> list[Position]:
        """The processes that listen now, in process order."""
        return [position for position in self.positions if position.admin is not None]

    def _channels(self) -> list[aio.Channel]:
        return [position.channel for position in self.reachable() if position.channel is not None]

    def control_addresses(self) -> list[str]:
        return [self.member(s.index).control_address() for s in self.reachable()]

    # -- processes ------------------------------------------------------------------------

    def _launch(self, position: Position) -> Path:
        """Write what the process starts with: the fleet as the admin API left it."""
        member = self.member(position.index)
        config = serving_config(
            self.config, member, self.port, self.desired.specs.values(), self.picker_port
        )
        discovered = dict(self.relay.claims) if self.relay is not None else {}
        drained = tuple(sorted(self.desired.drained))
        launch = Launch(config, member, drained, os.getpid(), discovered)
        path = Path(self._dir) / f"p{position.index}.launch"
        path.write_bytes(pickle.dumps(launch))
        return path

    async def _spawn(self, position: Position, timeout_s: float) -> None:
        """Start the position's process and wait (bounded) until it listens; raises
        NotStarted (the process is gone by then)."""
        position.started_at = time.monotonic()  # a start that fails counts as a short run
        path = self._launch(position)
        member = self.member(position.index)
        with contextlib.suppress(FileNotFoundError):
            member.socket_path(position.index).unlink()
        process = await start_process(position, path, timeout_s, self.stopping)
        assert process.stdout is not None
        self._tasks.spawn(
            drain_output(process.stdout), "process_output", serving_process=str(position.index)
        )
        position.channel = aio.insecure_channel(member.control_address())
        position.admin = admin_pb2_grpc.AdminServiceStub(position.channel)
        try:
            await reconcile(
                position.admin, self.desired, position.index, self.config.discovery_timeout_s
            )
        except aio.AioRpcError as exc:  # it died meanwhile, or is stuck: it is replaced
            log.warning(
                "reconcile_failed", serving_process=str(position.index), error=exc.details()
            )
        if self.relay is not None:
            await self.relay.catch_up(position.channel)

    async def _keep(self, position: Position) -> None:
        """Restart the position's process whenever it exits, until the gateway stops."""
        while True:
            assert position.process is not None
            code = await position.process.wait()
            await self._forget(position)
            if self.stopping:
                return
            ran_s = time.monotonic() - position.started_at
            if ran_s >= STABLE_S:
                position.backoff_s = 0.0
            else:
                position.backoff_s = min(
                    MAX_BACKOFF_S, max(FIRST_BACKOFF_S, position.backoff_s * 2)
                )
            log.error(
                "serving_process_exited",
                serving_process=str(position.index),
                code=code,
                ran_s=round(ran_s, 3),
                restart_in_s=position.backoff_s,
            )
            await asyncio.sleep(position.backoff_s)
            if self.stopping:
                return
            position.restarts += 1
            try:
                await self._spawn(position, self._start_timeout_s)
            except NotStarted as exc:
                log.error(
                    "serving_process_restart_failed",
                    serving_process=str(position.index),
                    error=str(exc),
                )
                continue
            log.info(
                "serving_process_restarted",
                serving_process=str(position.index),
                restarts=position.restarts,
            )

    async def _watch(self, position: Position) -> None:
        """Liveness: ask the position's process, once it listens, whether it answers on its
        control socket; after `liveness_misses` checks in a row without an answer it is
        killed (its keeper restarts it, with the same backoff as after a death). A process
        still starting, or any process once the gateway stops (it drains and closes its
        control socket), is not checked."""
        misses = 0
        while not self.stopping:
            started = time.monotonic()
            admin = position.admin
            if admin is not None and position.running:
                answered = await answers(admin, self.liveness_timeout_s)
                if answered or position.admin is not admin or self.stopping:
                    misses = 0
                else:
                    misses += 1
                    if misses >= self.liveness_misses:
                        timeout_s = self.liveness_timeout_s
                        self.replace(admin, f"no answer to {misses} checks of {timeout_s:g} s")
                        misses = 0
            else:
                misses = 0
            await asyncio.sleep(max(0.0, self.liveness_interval_s - (time.monotonic() - started)))

    def replace(self, admin: AdminStub, reason: str) -> None:
        """The process behind `admin` stopped answering: SIGKILL it (it may be stopped or
        wedged, past SIGTERM) and let its keeper restart it from the desired fleet. Only
        that process: if it was replaced meanwhile, nothing is done."""
        for position in self.positions:
            if position.admin is admin and position.running and not self.stopping:
                assert position.process is not None
                log.error(
                    "serving_process_unresponsive",
                    serving_process=str(position.index),
                    pid=position.process.pid,
                    reason=reason,
                )
                position.admin = None  # no more calls to it: the control plane leaves it out
                with contextlib.suppress(ProcessLookupError):
                    position.process.kill()

    @property
    def _start_timeout_s(self) -> float:
        return self.config.discovery_timeout_s + 30.0

    async def _forget(self, position: Position) -> None:
        position.admin = None
        channel, position.channel = position.channel, None
        if channel is not None:
            await channel.close()

    # -- signals --------------------------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        """Every serving process gets the signal (SIGTERM: all go NOT_SERVING at once and
        drain; a second signal: all stop now)."""
        self.signals.append(sig)
        self.stopping = True
        self._stop.set()
        self._forward(sig)

    def _forward(self, sig: signal.Signals) -> None:
        for position in self.positions:
            if position.running:
                assert position.process is not None
                with contextlib.suppress(ProcessLookupError):
                    position.process.send_signal(sig)

    def _reload(self) -> None:
        self.reloader.request()

    def _reloaded(self, done: Reload | None) -> None:
        """A reload read here (or not: `done` None): its config in force here, and in every
        process that listens: its launch file written again with its share, then SIGHUP
        (each reloads what it can: that config, its certificate and key files). One still
        starting reads its files as it starts, and ignores SIGHUP until then."""
        if done is not None and done.applied:
            self.config = done.config
            for position in self.positions:
                if position.running and position.admin is not None:
                    self._launch(position)
            log.info("reloaded", applied=list(done.applied))
        for position in self.positions:
            if position.running and position.admin is not None:
                assert position.process is not None
                with contextlib.suppress(ProcessLookupError):
                    position.process.send_signal(signal.SIGHUP)

    # -- run ------------------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; 0 once every process drained and exited, non-zero
        if a process could not start at all. Each step registers its own undoing on one
        stack, so whatever ends the run undoes what was done, in reverse order."""
        preflight(self.config)
        async with contextlib.AsyncExitStack() as undo:
            self._hold(undo)
            ended = await self._start(undo)
            if ended is not None:
                return ended
            await self._serve(undo)
            return await self._until_stopped()

    def _hold(self, undo: contextlib.AsyncExitStack) -> None:
        """The ports (the main one and the picker's, shared by the serving processes),
        the signal handlers, and the private directory (mode 0700: launch files and
        control sockets; if this process is killed outright, the last serving process to
        exit removes it, see `gateway.scale.child`)."""
        holder, self.port = hold_port(self.config.listen)
        undo.callback(holder.close)
        if self.config.picker.listen is not None:
            picker_holder, self.picker_port = hold_port(self.config.picker.listen)
            undo.callback(picker_holder.close)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        # The handlers stay until the very end: a signal now (say a second Ctrl-C) must
        # not end this process before it removed its directory.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            undo.callback(loop.remove_signal_handler, sig)
        self._dir = tempfile.mkdtemp(prefix="gateway-")
        undo.callback(shutil.rmtree, self._dir, ignore_errors=True)

    async def _start(self, undo: contextlib.AsyncExitStack) -> int | None:
        """The metrics endpoint, discovery's first reports, then every serving process;
        an exit code if start-up ended the run (a signal, a process that did not start)."""
        self._endpoint = endpoint = Endpoint(self.prometheus_registry())
        undo.callback(endpoint.close)
        undo.push_async_callback(self._kill_all)
        if self.relay is not None:  # the processes start with what it found
            undo.push_async_callback(self.relay.close)
            self.relay.start()
            timeout_s = self.config.discovery_timeout_s
            if not await self.relay.first_reports(timeout_s):
                log.warning("discovery_incomplete", waited_s=timeout_s)
        starts = await asyncio.gather(
            *(self._spawn(s, self._start_timeout_s) for s in self.positions),
            return_exceptions=True,
        )
        if self.signals:  # stopped during start-up: quietly, as one process does
            self._forward(signal.SIGTERM)
            await self._wait_all()
            return 0
        for start in starts:
            if isinstance(start, BaseException) and not isinstance(start, NotStarted):
                raise start
        failures = [f for f in starts if isinstance(f, NotStarted)]
        if not failures:
            return None
        for failure in failures:
            log.error("serving_process_not_started", error=str(failure))
        self.stopping = True
        self._forward(signal.SIGTERM)
        await self._wait_all()
        exits = [f.code for f in failures if f.code]
        return exits[0] if exits else 1

    async def _serve(self, undo: contextlib.AsyncExitStack) -> None:
        """The admin API over the fleet, the metrics port, each process's keeper and
        liveness watch; then READY."""
        discovered_by = self.relay.origins if self.relay is not None else _nobody
        control = ControlPlane(
            self.config, self.desired, self.reachable, self.replace, discovered_by
        )
        undo.push_async_callback(control.close)
        admin_server, admin_port = await serve_admin(control, self.config.admin)
        undo.push_async_callback(admin_server.stop, None)
        metrics_port = 0
        if self.config.metrics.listen:
            assert self._endpoint is not None
            try:
                metrics_port = self._endpoint.serve(self.config.metrics.listen)
            except OSError as exc:
                listen = self.config.metrics.listen
                raise CannotListen(listen, exc.strerror or str(exc)) from None
        undo.push_async_callback(self._tasks.close)
        undo.callback(self._no_restarts)  # undone first of all
        for position in self.positions:
            which = str(position.index)
            self._tasks.spawn(self._keep(position), "process_keeper", serving_process=which)
            self._tasks.spawn(self._watch(position), "process_liveness", serving_process=which)
        undo.push_async_callback(self.reloader.close)
        if self._watched is not None:
            self.reloader.spawn_watch(self._watched)
        log.info("serving", port=self.port, processes=self.count, admin_port=admin_port)
        line = ready_line(self.config, self.port, admin_port, metrics_port, self.picker_port)
        print(line, flush=True)

    async def _until_stopped(self) -> int:
        """Until SIGTERM/SIGINT; then every process drains and exits."""
        await self._stop.wait()
        log.info("draining", processes=sum(s.running for s in self.positions))
        codes = await self._wait_all()
        log.info("stopped", exit_codes=codes)
        return 1 if any(codes) else 0

    def _no_restarts(self) -> None:
        self.stopping = True

    async def _kill_all(self) -> None:
        """Whatever still runs is killed, and forgotten."""
        self.stopping = True
        for position in self.positions:
            if position.running:
                assert position.process is not None
                position.process.kill()
                await position.process.wait()
            await self._forget(position)

    async def _wait_all(self) -> list[int]:
        """Wait for every running process to exit (they drain on their own)."""
        return list(
            await asyncio.gather(
                *(s.process.wait() for s in self.positions if s.process is not None and s.running)
            )
        )

    def prometheus_registry(self) -> CollectorRegistry:
        registry, own = CollectorRegistry(), CollectorRegistry()
        process_series(own)  # merged with the serving processes' (same names)
        build_series(own)  # there even while no serving process answers
        registry.register(ProcessesCollector(self.control_addresses, self.positions, own=own))
        relay = self.relay
        if relay is not None:
            registry.register(DiscoveryCollector(lambda: relay.sources.stats))
        return registry


def _nobody(address: str) -> list[str]:
    return []


async def supervise(
    config: GatewayConfig, reread: Reread | None = None, watch: str | None = None
) -> int:
    return await Supervisor(config, reread, watch).run()
