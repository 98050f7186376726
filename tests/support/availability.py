"""Helpers for the availability end-to-end tests: closed-loop load,
timed watchers of the admin and health streams, admin and metrics clients, the `--worker`
flags of simulated workers (urls) and which worker served each of a run of calls
(served_by).

Times are `time.monotonic()` unless a name says `wall` (log lines carry wall-clock
timestamps, so request starts read from the log are compared with `time.time()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.client import (
    channel,
    collect,
    generate_for,
    list_workers,
    model_md,
    sgl_generate,
    sgl_grpc,
    status_name,
    stub_for,
)
from gateway_sim.launch import START_S, Child, worker_url
from tests.support.waits import WAIT_S

T = TypeVar("T")


# --------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class CallResult:
    """One Generate call of a closed loop, as the client saw it."""

    request_id: str
    started: float  # monotonic
    ended: float  # monotonic
    worker: str | None  # the x-sim-worker response header (None: no headers)
    messages: int
    code: grpc.StatusCode
    details: str


class ClosedLoop:
    """`loops` clients, each sending one short Generate stream after the other.

    Every call has a deadline, so a hang shows as DEADLINE_EXCEEDED rather than a stuck
    test; the loops themselves stop at `stop()` or at `max_s`, whichever comes first.
    """

    def __init__(
        self,
        address: str,
        model: str = "m",
        *,
        loops: int = 4,
        tokens: int = 4,
        token_ms: float = 10.0,
        call_timeout_s: float = 5.0,
        max_s: float = 30.0,
        prefix: str = "load",
    ) -> None:
        self.address = address
        self.model = model
        self.loops = loops
        self.tokens = tokens
        self.token_ms = token_ms
        self.call_timeout_s = call_timeout_s
        self.max_s = max_s
        self.prefix = prefix
        self.results: list[CallResult] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._channel: aio.Channel | None = None

    async def __aenter__(self) -> ClosedLoop:
        self._channel = channel(self.address)
        stub = sgl_grpc.SglangSchedulerStub(self._channel)
        deadline = time.monotonic() + self.max_s
        self._tasks = [
            asyncio.create_task(self._loop(stub, i, deadline)) for i in range(self.loops)
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        self._stop.set()
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=self.call_timeout_s + 2)
            for task in pending:
                task.cancel()
            for task in done:
                task.result()  # a bug in the loop itself must not pass silently
            assert not pending, f"{len(pending)} load loops did not stop"
            self._tasks = []
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _loop(self, stub: Any, index: int, deadline: float) -> None:
        metadata = model_md(self.model, ("x-sim-token-ms", str(self.token_ms)))
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            request_id = f"{self.prefix}-{index}-{n}"
            n += 1
            started = time.monotonic()
            call = stub.Generate(
                sgl_generate(request_id, tokens=self.tokens),
                metadata=metadata,
                timeout=self.call_timeout_s,
            )
            messages, error = await collect(call)
            headers = dict(await call.initial_metadata() or ())
            worker = headers.get("x-sim-worker")
            self.results.append(
                CallResult(
                    request_id,
                    started,
                    time.monotonic(),
                    str(worker) if worker is not None else None,
                    len(messages),
                    error.code() if error else grpc.StatusCode.OK,
                    (error.details() or "") if error else "",
                )
            )

    def failures(self) -> list[CallResult]:
        return [r for r in self.results if r.code is not grpc.StatusCode.OK]

    def served_by(self, since: float = 0.0) -> dict[str, int]:
        """Calls started at or after `since` that ended OK, by worker name."""
        counts: dict[str, int] = {}
        for r in self.results:
            if r.started >= since and r.code is grpc.StatusCode.OK and r.worker:
                counts[r.worker] = counts.get(r.worker, 0) + 1
        return counts

    async def wait_calls(self, count: int, within_s: float = WAIT_S) -> None:
        """Until at least `count` calls have finished (bounded)."""
        deadline = time.monotonic() + within_s
        while True:
            if len(self.results) >= count:
                return
            assert time.monotonic() < deadline, f"only {len(self.results)} calls in {within_s}s"
            await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- streams


@dataclass
class Recorder(Generic[T]):
    """Reads a server stream in the background, stamping each message on arrival."""

    call: Any
    items: list[tuple[float, T]] = field(default_factory=list)
    error: aio.AioRpcError | None = None
    _task: asyncio.Task[None] | None = None
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> Recorder[T]:
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for item in self.call:
                self.items.append((time.monotonic(), item))
                self._arrived.set()
        except aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.CANCELLED:
                self.error = error
        finally:
            self._arrived.set()

    async def wait_for(
        self, predicate: Callable[[T], bool], within_s: float, after: float = float("-inf")
    ) -> tuple[float, T]:
        """The first item that arrived later than `after` and matches, with its arrival
        time (waiting up to `within_s` for it)."""
        deadline = time.monotonic() + within_s
        while True:
            for stamp, item in list(self.items):
                if stamp > after and predicate(item):
                    return stamp, item
            left = deadline - time.monotonic()
            if left <= 0 or self.error is not None or (self._task and self._task.done()):
                seen = [item for _, item in self.items]
                raise AssertionError(
                    f"no matching item within {within_s}s (error {self.error}); saw {seen}"
                )
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), min(left, 0.05))

    async def close(self) -> None:
        self.call.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, 2)


def health_watch(ch: aio.Channel, name: str) -> Recorder[int]:
    """A started recorder of `Health/Watch(name)`: the statuses as they arrive."""
    call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=name))
    return Recorder[int](_Mapped(call, lambda reply: int(reply.status))).start()


class _Mapped:
    """A server-streaming call whose messages are mapped on the way out; cancel passes."""

    def __init__(self, call: Any, fn: Callable[[Any], Any]) -> None:
        self._call = call
        self._fn = fn

    def __aiter__(self) -> Any:
        return self._gen()

    async def _gen(self) -> Any:
        async for item in self._call:
            yield self._fn(item)

    def cancel(self) -> None:
        self._call.cancel()


def admin_watch(ch: aio.Channel, metadata: Sequence[tuple[str, str]] = ()) -> Recorder[Any]:
    """A started recorder of the admin WatchWorkers stream."""
    call = admin_pb2_grpc.AdminServiceStub(ch).WatchWorkers(
        admin_pb.WatchWorkersRequest(), metadata=tuple(metadata) or None
    )
    return Recorder[Any](call).start()


def status_event(worker_id: str, new: int) -> Callable[[Any], bool]:
    """Matches a STATUS event of `worker_id` to status `new` (admin_pb.WORKER_STATUS_*)."""

    def match(event: Any) -> bool:
        return bool(
            event.kind == admin_pb.WORKER_EVENT_KIND_STATUS
            and event.worker.id == worker_id
            and event.status_change.new_status == new
        )

    return match


# --------------------------------------------------------------------------- health


async def health_list(address: str) -> dict[str, str]:
    """Every health entry by name, with its status name."""
    async with channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=2)
    return {name: status_name(s.status) for name, s in reply.statuses.items()}


async def wait_worker(
    address: str, worker_id: str, predicate: Callable[[Any], bool], within_s: float = WAIT_S
) -> Any:
    """Poll ListWorkers (bounded) until the worker matches; returns it."""
    deadline = time.monotonic() + within_s
    while True:
        worker = (await list_workers(address)).get(worker_id)
        if worker is not None and predicate(worker):
            return worker
        assert time.monotonic() < deadline, f"worker {worker_id} never matched: {worker}"
        await asyncio.sleep(0.02)


def is_ready(worker: Any) -> bool:
    return bool(worker.status == admin_pb.WORKER_STATUS_READY and worker.connected)


def run_cli(
    *args: str, timeout: float = START_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m gateway ARGS` to its end (the admin client verbs). The environment is
    this one without GATEWAY_ADMIN_TOKEN, plus `env`."""
    environ = {k: v for k, v in os.environ.items() if k != "GATEWAY_ADMIN_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**environ, **(env or {})},
    )


async def run_cli_async(
    *args: str, within_s: float = START_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`run_cli` off the event loop, so streams the test holds keep flowing."""
    return await asyncio.to_thread(run_cli, *args, timeout=within_s, env=env)


# --------------------------------------------------------------------------- logs, metrics


def wall_start(event: dict[str, Any]) -> float:
    """When a logged request started (wall clock): its log time minus its duration."""
    logged = datetime.fromisoformat(str(event["timestamp"])).timestamp()
    return logged - float(event["duration_ms"]) / 1000.0


def scrape(gw: Child) -> str:
    url = f"http://127.0.0.1:{gw.port_of('metrics')}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every sample of metric `name` in a Prometheus text exposition, by its label set."""
    found: dict[frozenset[tuple[str, str]], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        labels = frozenset(_LABEL.findall(match["labels"] or ""))
        found[labels] = float(match["value"])
    return found


def labels(**values: str) -> frozenset[tuple[str, str]]:
    return frozenset(values.items())


def urls(*children: Child, model: str = "m", runtime: str = "sglang") -> list[str]:
    args: list[str] = []
    for child in children:
        args += ["--worker", worker_url(child, model=model, runtime=runtime)]
    return args


async def served_by(
    address: str, count: int, model: str = "m", runtime: str = "sglang"
) -> list[str]:
    """`count` sequential Generate calls; the worker name that served each (all must be OK)."""
    names = []
    async with channel(address) as ch:
        stub = stub_for(ch, runtime)
        for i in range(count):
            call = stub.Generate(
                generate_for(runtime, f"s{i}", tokens=1), metadata=model_md(model), timeout=5
            )
            messages, error = await collect(call)
            assert error is None, (error.code(), error.details())
            assert len(messages) == 2
            names.append(str(dict(await call.initial_metadata())["x-sim-worker"]))
    return names
