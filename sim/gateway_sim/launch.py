"""Start gateway and simulator processes and wait for their `READY <port>` line.

Shared by the demo, the end-to-end tests, the benchmarks and the attack scripts so that
every one of them starts real processes the same way, and stops every process it started.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# Safety net for a process's start-up: some 1.5 s idle, 10 s for a `--processes 2`
# gateway beside two CPU-bound jobs. Only a hang reaches it.
START_S = 60.0

# `gateway serve` as the tests and scripts run it: every port picked free, no drain delay,
# JSON logs.
SERVE_ARGS = (
    "serve",
    "--listen",
    "127.0.0.1:0",
    "--admin-listen",
    "127.0.0.1:0",
    "--metrics-listen",
    "127.0.0.1:0",
    "--drain-delay",
    "0",
    "--log-format",
    "json",
)


class NotReady(RuntimeError):
    """A started process exited, or stayed silent, before its READY line."""


@dataclass
class Child:
    """A started process and the port it announced."""

    process: subprocess.Popen[str]
    port: int
    args: tuple[str, ...]
    extra: dict[str, str] = field(default_factory=dict)  # `name=host:port` after the port
    # Where its stderr goes: nowhere unless its starter sent it to a file (a test's log).
    log_path: Path = Path(os.devnull)

    def port_of(self, name: str) -> int:
        """The port announced as `name=host:port` (e.g. admin, metrics)."""
        return int(self.extra[name].rpartition(":")[2])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL (a crash, as far as anyone else can tell) and reap."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()


def spawn(
    args: Sequence[str],
    *,
    stderr: int | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.Popen[str]:
    """Run `python -m gateway ARGS` (in `cwd`: `-m` imports from there first); `ready`
    waits for its READY line."""
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def ready(process: subprocess.Popen[str], args: Sequence[str], timeout: float = 20.0) -> Child:
    """Wait (bounded) for the READY line of a spawned process; kills it if none comes."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([process.stdout], [], [], 0.1)
        if readable:
            line = process.stdout.readline()
            if line.startswith("READY "):
                words = line.split()
                port = int(words[1].rpartition(":")[2])
                extra = dict(w.split("=", 1) for w in words[2:] if "=" in w)
                return Child(process, port, tuple(args), extra)
            if not line and process.poll() is not None:
                break
        elif process.poll() is not None:
            break
    process.kill()
    process.wait()
    raise NotReady(f"gateway {' '.join(args)} did not become ready (exit {process.returncode})")


def start(
    args: Sequence[str],
    *,
    timeout: float = 20.0,
    stderr: int | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> Child:
    """Run `python -m gateway ARGS` and wait (bounded) for its READY line."""
    return ready(spawn(args, stderr=stderr, env=env, cwd=cwd), args, timeout)


def sim_args(*args: str) -> list[str]:
    return ["sim", "--listen", "127.0.0.1:0", *args]


def start_sim(*args: str, **kwargs: object) -> Child:
    return start(sim_args(*args), **kwargs)  # type: ignore[arg-type]


def stop_all(processes: Sequence[subprocess.Popen[str]], timeout: float = 5.0) -> None:
    """SIGTERM every process, then SIGKILL whichever has not exited in time; reap all."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()


def worker_url(child: Any, **query: str) -> str:
    """`grpc://127.0.0.1:PORT?model=m&runtime=sglang` for a started simulator (anything
    with an `address`)."""
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return f"grpc://{child.address}" + (f"?{params}" if params else "")


def graceful(child: Child) -> bool:
    """Whether a child must be stopped with SIGTERM when its user is done: a supervisor
    (`--processes N`) and the demo stop processes of their own, which SIGKILL would leave
    behind. Anything else is SIGKILLed: a gateway's SIGTERM drain takes ~0.6 s even with
    nothing in flight, and nobody checks it (the tests of the drain and of the exit code
    send their own signals and assert on what follows)."""
    return "--processes" in child.args or child.args[:1] == ("demo",)


def stop_child(child: Child) -> None:
    if graceful(child):
        child.stop()
    else:
        child.kill()


def start_many(launch: Callable[..., Any], *argsets: Sequence[str]) -> list[Any]:
    """Start several processes at once (each start waits for READY: in parallel it is faster)."""
    with ThreadPoolExecutor(max_workers=len(argsets)) as pool:
        return list(pool.map(lambda args: launch(*args), argsets))


class Hosted(Protocol):
    """A simulated worker served by a host process rather than a process of its own."""

    def stop(self) -> None: ...


class Host(Protocol):
    """What starts hosted simulated workers (the tests' shared host process)."""

    def start(self, *args: str) -> Any: ...


class SharedProcesses:
    """Processes shared by several users (a module-scoped fixture's tests, an attack
    scenario's run): starting Python processes is most of an end-to-end run's cost.
    Simulated workers are hosted by `host` if given, else processes of their own."""

    def __init__(self, log_dir: Path, host: Host | None = None) -> None:
        self.children: list[Any] = []
        self._log_dir = log_dir
        self._host = host

    def sim(self, *args: str) -> Any:
        child: Child | Hosted
        if self._host is not None:
            child = self._host.start(*args)
        else:
            child = start_sim(*args, timeout=START_S)
        self.children.append(child)
        return child

    def sims(self, *argsets: Sequence[str]) -> list[Child]:
        return start_many(self.sim, *argsets)

    def gateway(self, *args: str) -> Child:
        log_path = self._log_dir / f"gateway-{len(self.children)}.log"
        with open(log_path, "w") as log_file:
            child = start([*SERVE_ARGS, *args], stderr=log_file.fileno(), timeout=START_S)
        child.log_path = log_path
        self.children.append(child)
        return child

    def stop(self) -> None:
        for child in reversed(self.children):
            if isinstance(child, Child):
                stop_child(child)
            else:
                child.stop()
