"""Client connections: file-descriptor headroom for the cap, and a watch that says when
the cap is reached.

grpc core enforces `limits.max_connections` itself (`grpc.max_allowed_incoming_connections`:
it closes the connections past it as they arrive) but tells nobody. So a watch counts
this process's established connections on the main port every few seconds (from
/proc, in a thread) and logs once when the cap is reached and once when it is not any
more: an operator sees why new clients are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
from pathlib import Path

import structlog

log = structlog.get_logger("gateway.connections")

FD_HEADROOM = 256  # descriptors beyond client connections: workers, files, the admin port
WATCH_INTERVAL_S = 2.0
ESTABLISHED = "01"


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; warn when the connection cap does
    not fit under it. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if max_connections + FD_HEADROOM > soft:
        log.warning(
            "connection_cap_over_fd_limit",
            max_connections=max_connections,
            fd_limit=soft,
            detail="raise the file-descriptor limit or lower limits.max_connections",
        )
    return soft


def _socket_inodes() -> set[str]:
    inodes = set()
    fd_dir = Path("/proc/self/fd")
    for name in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(fd_dir / name)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def count_connections(port: int) -> int:
    """This process's established TCP connections whose local port is `port`."""
    ours = _socket_inodes()
    wanted = f":{port:04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if (
                len(fields) > 9
                and fields[3] == ESTABLISHED
                and fields[1].endswith(wanted)
                and fields[9] in ours
            ):
                count += 1
    return count


class ConnectionWatch:
    """Logs `connection_limit_reached` / `connection_limit_cleared` as the count crosses
    the cap; `count` is the last count seen."""

    def __init__(self, port: int, cap: int, interval_s: float = WATCH_INTERVAL_S) -> None:
        self.port, self.cap, self.interval_s = port, cap, interval_s
        self.count = 0
        self.at_cap = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if Path("/proc/net/tcp").exists():
            self._task = asyncio.ensure_future(self._run())

    def observe(self, count: int) -> None:
        self.count = count
        if count >= self.cap and not self.at_cap:
            self.at_cap = True
            log.warning(
                "connection_limit_reached",
                connections=count,
                max_connections=self.cap,
                detail="new client connections are closed until some end",
            )
        elif count < self.cap and self.at_cap:
            self.at_cap = False
            log.info("connection_limit_cleared", connections=count, max_connections=self.cap)

    async def _run(self) -> None:
        while True:
            try:
                self.observe(await asyncio.to_thread(count_connections, self.port))
            except Exception:
                log.exception("connection_count_failed")
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
