"""The gateway seen from outside while a scenario runs: the observer processes (the
legitimate client and the health prober, scripts/attacks/measure.py), asked over their
stdin, and the gateway's RSS and threads, sampled from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ATTACK_PY = ROOT / "scripts" / "attack.py"
SAMPLE_EVERY_S = 0.05  # the gateway's /proc/PID/status
MIB = 1024 * 1024


class Observer:
    """One observer process (scripts/attacks/measure.py), asked over its stdin."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, role: str, *args: str) -> Observer:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ATTACK_PY),
            role,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        return cls(process)

    async def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n".encode())
        await self.process.stdin.drain()

    async def connect(self, address: str) -> None:
        await self.tell(f"connect {address}")

    async def measure(self, label: str, seconds: float) -> dict[str, Any]:
        """Its figures for the next `seconds` (bounded: a stuck observer is an error)."""
        assert self.process.stdout is not None
        await self.tell(f"run {label} {seconds}")
        line = await asyncio.wait_for(self.process.stdout.readline(), seconds + 30)
        if not line:
            raise RuntimeError(
                f"observer {self.process.pid} ended (exit {self.process.returncode})"
            )
        result: dict[str, Any] = json.loads(line)
        return result

    async def stop(self) -> None:
        process = self.process
        if process.returncode is None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
                assert process.stdin is not None
                process.stdin.write(b"quit\n")
                process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 3)
            except TimeoutError:
                process.kill()
                await process.wait()


def proc_status(pid: int) -> tuple[int, int]:
    """VmRSS (bytes) and Threads of a process, from /proc/PID/status."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


class Memory:
    """Samples the gateway's RSS and threads in a thread of its own (every 50 ms), so a
    peak between two reads of the run is seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.samples.append((time.monotonic(), *proc_status(self.pid)))
            self._stop.wait(SAMPLE_EVERY_S)

    def now(self) -> tuple[float, int]:
        rss, threads = proc_status(self.pid)
        return rss / MIB, threads

    def peak(self, since: float) -> tuple[float, int]:
        window = [s for s in self.samples if s[0] >= since] or [(0.0, *proc_status(self.pid))]
        return max(s[1] for s in window) / MIB, max(s[2] for s in window)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1)
