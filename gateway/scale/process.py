"""A serving process seen from the supervisor: its position (what survives a restart),
and starting one: the child started in its own session, waited on (bounded) until it
prints READY, its later output read and dropped so its pipe never fills."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.observability.corelog import real_stderr
from gateway.scale.desired import AdminStub


class NotStarted(RuntimeError):
    """A serving process exited, or stayed silent, before it listened."""

    def __init__(self, index: int, detail: str, code: int | None = None) -> None:
        super().__init__(f"serving process {index} did not start: {detail}")
        self.code = code


@dataclass
class Position:
    """One serving process position; its process is replaced when it dies."""

    index: int
    process: asyncio.subprocess.Process | None = None
    channel: aio.Channel | None = None
    admin: AdminStub | None = None  # set once it listens: the control plane reaches it
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


async def start_process(
    position: Position, path: Path, timeout_s: float, stopping: bool
) -> asyncio.subprocess.Process:
    """Start the position's process from its launch file and wait until it listens. The
    process is the position's at once, so that signals forwarded meanwhile reach it; with
    `stopping`, it is told SIGTERM at once. Raises NotStarted (the process gone by then)."""
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.scale.child",
            str(path),
            stdout=asyncio.subprocess.PIPE,
            stderr=real_stderr(),  # its own lines: not through the supervisor's pipe
            start_new_session=True,  # a Ctrl-C reaches the supervisor only; it forwards
        )
    except OSError as exc:  # e.g. out of processes or memory: try again later
        raise NotStarted(position.index, exc.strerror or str(exc)) from None
    position.process = process
    if stopping:
        process.send_signal(signal.SIGTERM)
    assert process.stdout is not None
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                line = await process.stdout.readline()
                if line.startswith(b"READY "):
                    return process
                if not line:
                    code = await process.wait()
                    raise NotStarted(position.index, f"exit status {code}", code)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise NotStarted(position.index, f"not listening after {timeout_s:g} s") from None


async def drain_output(stream: asyncio.StreamReader) -> None:
    """Read and drop what a process prints after READY, so its pipe never fills."""
    while await stream.readline():
        pass


async def answers(admin: AdminStub, timeout_s: float) -> bool:
    """Liveness: whether the process behind `admin` answers on its control socket."""
    try:
        async with asyncio.timeout(timeout_s):
            await admin.ListWorkers(admin_pb.ListWorkersRequest(), timeout=timeout_s)
    except (TimeoutError, aio.AioRpcError):
        return False
    return True
