"""One scenario's run: its processes, tasks, channels and files (stopped on every path),
the scenario's steps, and the outcome put together (the observers and the memory samples:
observe.py; the outcome, its criteria and how it is printed: outcome.py).

A run: the scenario starts its workers (beside the legitimate client's own simulated
worker, model `legit`) and a gateway; the legitimate client and the health prober measure
a baseline; the attack begins and they measure again while it lasts; the attack ends
(the scenario waits for the state it leaves, e.g. an empty queue), the run settles, and
the gateway's RSS and threads are read once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import grpc
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.client import MAX, admin_address, list_workers, wait_health, write_config
from gateway_sim.launch import SERVE_ARGS, Child, SharedProcesses, start, worker_url
from scripts.attacks.observe import Memory, Observer
from scripts.attacks.outcome import Check, Outcome

LEGIT_MODEL = "legit"

BASELINE_S = 5.0
ATTACK_S = 10.0
SETTLE_S = 3.0
ADMIN_TIMEOUT_S = 10.0  # an admin answer from a gateway under attack may be slow
STATE_WAIT_S = 20.0  # bound on every wait for the state an attack leaves
STREAMS_PER_CHANNEL = 125  # under grpc's 256 concurrent streams per connection

T = TypeVar("T")


def local_channel(address: str) -> aio.Channel:
    """A channel with a connection of its own (a second client, or more streams than one
    connection may carry)."""
    return aio.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", MAX),
            ("grpc.max_receive_message_length", MAX),
            ("grpc.enable_retries", 0),
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


class Run:
    """One scenario's processes, tasks, channels and files: all of them stopped, closed
    or removed when the run ends, however it ends (an error, Ctrl-C)."""

    def __init__(self, name: str, tree: Path | None = None) -> None:
        self.tree = tree  # the gateway's code, if not this checkout's
        self.dir = Path(tempfile.mkdtemp(prefix=f"attack-{name}-"))
        self.processes = SharedProcesses(self.dir)
        self.legit: Child | None = None
        self.gw: Child | None = None
        self.observers: list[Observer] = []
        self.memory: Memory | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._channels: list[aio.Channel] = []
        self._cleanups: list[Callable[[], object]] = []

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cancel_spawned()
        for ch in self._channels:
            with contextlib.suppress(Exception):
                await ch.close(grace=None)
        for observer in self.observers:
            with contextlib.suppress(Exception):
                await observer.stop()
        if self.memory is not None:
            self.memory.stop()
        for cleanup in reversed(self._cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        self.processes.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # processes

    def workers(self, *argsets: Sequence[str]) -> list[Child]:
        """The legitimate client's worker and the scenario's, started side by side."""
        legit, *others = self.processes.sims(("--model", LEGIT_MODEL, "--name", "legit"), *argsets)
        self.legit = legit
        return others

    def gateway(self, config: dict[str, Any], *workers: str) -> Child:
        """`gateway serve` with `config` in front of the legit worker and `workers` (URLs)."""
        assert self.legit is not None, "start the workers first"
        urls = [worker_url(self.legit, model=LEGIT_MODEL, runtime="sglang"), *workers]
        flags = [arg for url in urls for arg in ("--worker", url)]
        args = [*SERVE_ARGS, "--config", write_config(self.dir, config), *flags]
        with open(self.dir / "gateway.log", "w") as log:
            cwd = str(self.tree) if self.tree is not None else None
            self.gw = start(args, stderr=log.fileno(), cwd=cwd)
        self.processes.children.append(self.gw)
        return self.gw

    def on_exit(self, cleanup: Callable[[], object]) -> None:
        """Something else to stop when the run ends (a process, a socket)."""
        self._cleanups.append(cleanup)

    # tasks and channels

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task of the attack; cancelled when the run ends if it has not."""
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        return task

    def channel(self, address: str | None = None) -> aio.Channel:
        """A client connection of the attacker's (to the gateway by default)."""
        assert address is not None or self.gw is not None
        ch = local_channel(address or self.gw.address)  # type: ignore[union-attr]
        self._channels.append(ch)
        return ch

    async def cancel_spawned(self) -> None:
        """Every task of the attack so far cancelled, and ended."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close_channels(self) -> None:
        """The attacker's connections closed now (every call on them cancelled)."""
        channels, self._channels = self._channels, []
        for ch in channels:
            await ch.close(grace=None)

    # the gateway's state

    async def listed_workers(self) -> dict[str, Any]:
        """ListWorkers (retried while a stalled gateway misses its deadline)."""
        assert self.gw is not None
        address = admin_address(self.gw)
        return await patiently(lambda: list_workers(address))

    async def waiting(self) -> int:
        """Calls waiting in the gateway's queues (admin ListQueues), over every model."""
        assert self.gw is not None
        async with aio.insecure_channel(admin_address(self.gw)) as ch:
            listed = await admin_pb2_grpc.AdminServiceStub(ch).ListQueues(
                admin_pb.ListQueuesRequest(), timeout=ADMIN_TIMEOUT_S
            )
        return sum(q.waiting for q in listed.queues)


async def patiently(ask: Callable[[], Awaitable[T]], tries: int = 5) -> T:
    """`ask()`, again after a missed deadline (a gateway under attack answers late)."""
    for attempt in range(tries):
        try:
            return await ask()
        except aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


async def until(
    check: Callable[[], Awaitable[bool]], within_s: float, every_s: float = 0.1
) -> bool:
    """Poll `check` until it holds (True) or `within_s` passed (False)."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)
    return True


# --------------------------------------------------------------------------- scenarios


class Scenario:
    """One attack. A fresh instance per run holds the attack's state between its steps."""

    name: ClassVar[str]
    summary: ClassVar[str]
    settle_s: ClassVar[float] = SETTLE_S
    legit_tenant: ClassVar[str | None] = None  # the legitimate client's x-tenant-id
    legit_key: ClassVar[str | None] = None  # ... and API key

    def __init__(self, run: Run) -> None:
        self.run = run
        self.checks: list[Check] = []

    def unavailable(self) -> str | None:
        """Why the scenario cannot run here (skipped with that message), if it cannot."""
        return None

    async def prepare(self) -> Child:
        """Start the workers (`run.workers`) and the gateway (`run.gateway`)."""
        raise NotImplementedError

    async def ready(self, gw: Child) -> None:
        """Until the legitimate client's model is servable (bounded)."""
        await wait_health(gw.address, LEGIT_MODEL)

    async def begin(self) -> None:
        """Start the attack (background tasks: `run.spawn`) and return."""
        raise NotImplementedError

    async def end(self) -> None:
        """Stop the attack and wait for the state it leaves (bounded)."""
        raise NotImplementedError

    def judge(self, baseline: dict[str, Any], attack: dict[str, Any]) -> list[Check]:
        """Criteria of the scenario's own on the legitimate client's figures."""
        return []

    def note(self, name: str, shown: str, passed: bool | None = None) -> None:
        self.checks.append(Check(name, shown, passed))


async def drive(
    kind: type[Scenario],
    baseline_s: float = BASELINE_S,
    attack_s: float = ATTACK_S,
    tree: Path | None = None,
) -> Outcome:
    """Run one scenario from its first process to its last, every process stopped after
    (`tree`: a source tree whose gateway code the gateway runs, e.g. the code before a
    fix, exported with `git archive`)."""
    started = time.monotonic()
    async with Run(kind.name, tree) as run:
        scenario = kind(run)
        reason = scenario.unavailable()
        if reason is not None:
            return Outcome(kind.name, kind.summary, skipped=reason)
        # The observers start first: they import while the workers and the gateway start.
        who = [*(("--tenant", kind.legit_tenant) if kind.legit_tenant else ())]
        who += [*(("--key", kind.legit_key) if kind.legit_key else ())]
        legit = await Observer.start("_legit", *who)
        run.observers.append(legit)
        prober = await Observer.start("_health")
        run.observers.append(prober)
        gw = await scenario.prepare()
        await scenario.ready(gw)
        for observer in run.observers:
            await observer.connect(gw.address)
        memory = run.memory = Memory(gw.process.pid)

        async def observe(label: str, seconds: float) -> tuple[dict[str, Any], dict[str, Any]]:
            calls, stalls = await asyncio.gather(
                legit.measure(label, seconds), prober.measure(label, seconds)
            )
            return calls, stalls

        legit_base, health_base = await observe("baseline", baseline_s)
        rss_base, threads_base = memory.now()
        attack_from = time.monotonic()
        await scenario.begin()
        legit_attack, health_attack = await observe("attack", attack_s)
        await scenario.end()
        await asyncio.sleep(kind.settle_s)
        rss_peak, threads_peak = memory.peak(since=attack_from)
        rss_after, threads_after = memory.now()
        return Outcome(
            kind.name,
            kind.summary,
            legit=(legit_base, legit_attack),
            health=(health_base, health_attack),
            rss_mib=(rss_base, rss_peak, rss_after),
            threads=(threads_base, threads_peak, threads_after),
            checks=[*scenario.checks, *scenario.judge(legit_base, legit_attack)],
            seconds=time.monotonic() - started,
        )
