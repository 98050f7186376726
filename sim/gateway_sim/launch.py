"""Start gateway and simulator processes and wait for their `READY <port>` line.

Shared by the demo, the end-to-end tests and the benchmark so that every one of them
starts real processes the same way, and stops every process it started.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


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
