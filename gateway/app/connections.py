"""Client connections: file-descriptor headroom for the cap, a watch that says when the
cap is reached, and the per-peer cap.

grpc core enforces `limits.max_connections` itself (`grpc.max_allowed_incoming_connections`:
it closes the connections past it as they arrive) but tells nobody, and it has no bound
per peer. So a watch reads this process's established connections on the main port
(and the picker's, `picker.listen`: a peer's connections to both count together)
every few seconds (from /proc, in a thread): it logs once when the cap is reached and
once when it is not any more, and shuts down a peer's newest connections past
`limits.max_connections_per_peer` under grpc core (which drops them as if the peer had),
so one client address cannot keep the whole connection budget for long.

"Newest" is by when the watch first saw a connection: /proc keeps no creation time, and
socket inode numbers are handed out in per-CPU batches, so they are not in creation order.
Connections first seen in the same census are ordered by inode, the best guess left.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import resource
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gateway.core.address import unmapped
from gateway.core.tasks import TaskScope

log = structlog.get_logger("gateway.app.connections")

FD_HEADROOM = 256  # descriptors beyond client connections: workers, files, the admin port
WATCH_INTERVAL_S = 2.0
ESTABLISHED = "01"
NOT_SEEN = 1 << 62  # the census number of a connection no census has seen: after all others


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


def _socket_fds() -> dict[str, int]:
    """This process's sockets: inode -> file descriptor."""
    sockets = {}
    fd_dir = Path("/proc/self/fd")
    for name in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            target = os.readlink(fd_dir / name)
            if target.startswith("socket:["):
                sockets[target[8:-1]] = int(name)
    return sockets


def connections(ports: Sequence[int]) -> dict[str, list[tuple[int, int]]]:
    """This process's established TCP connections on the local `ports`, by peer address
    (as /proc spells it, hex): (inode, file descriptor) each, lowest inode first."""
    ours = _socket_fds()
    wanted = tuple(f":{port:04X}" for port in ports)
    by_peer: dict[str, list[tuple[int, int]]] = {}
    # /proc/net/tcp is read in pieces while the kernel changes it: a line can come twice.
    counted: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == ESTABLISHED and fields[1].endswith(wanted):
                fd = ours.get(fields[9])
                if fd is not None and fields[9] not in counted:
                    counted.add(fields[9])
                    peer = fields[2].rpartition(":")[0]
                    by_peer.setdefault(peer, []).append((int(fields[9]), fd))
    for held in by_peer.values():
        held.sort()
    return by_peer


def peer_ip(hex_address: str) -> str:
    """/proc's hex address (little-endian 32-bit words) as an IP address."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(unmapped(ipaddress.ip_address(words)))


def close_connection(inode: int, fd: int) -> bool:
    """Shut the connection down under grpc core (which then drops it as a peer would);
    only if `fd` still is that socket (its number may have been reused meanwhile)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:
            return False
        with socket.socket(fileno=dup) as sock:
            dup = -1  # the socket object owns it now
            sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        if dup >= 0:
            os.close(dup)


@dataclass(frozen=True, slots=True)
class Census:
    total: int
    over: dict[str, int]  # peer IP -> connections closed past its cap
    seen: frozenset[int]  # the inodes of the connections counted


def census(ports: Sequence[int], per_peer: int, first_seen: Mapping[int, int]) -> Census:
    """Count the connections; close each peer's newest ones past `per_peer`, by the
    census that first saw them (`first_seen`: inode -> its number), then by inode."""
    by_peer = connections(ports)

    def age(entry: tuple[int, int]) -> int:  # a stable sort keeps inode order within one
        return first_seen.get(entry[0], NOT_SEEN)

    over: dict[str, int] = {}
    for peer, held in by_peer.items():
        extra = sorted(held, key=age)[per_peer:]
        if extra:
            over[peer_ip(peer)] = sum(close_connection(inode, fd) for inode, fd in extra)
    seen = frozenset(inode for held in by_peer.values() for inode, _ in held)
    return Census(sum(len(held) for held in by_peer.values()), over, seen)


class ConnectionWatch:
    """Every few seconds: logs `connection_limit_reached` / `connection_limit_cleared` as
    the count crosses `cap` (grpc core enforces it), and closes a peer's connections past
    `per_peer` (grpc core has no such bound), newest first, logging
    `connection_per_peer_limit` once per peer until it is back under. `count` is the
    last count seen; `report(count, closed)` hears each census (metrics)."""

    def __init__(
        self,
        ports: Sequence[int],
        cap: int,
        per_peer: int,
        interval_s: float = WATCH_INTERVAL_S,
        report: Callable[[int, int], None] | None = None,
    ) -> None:
        self.ports, self.cap, self.per_peer, self.interval_s = (
            tuple(ports),
            cap,
            per_peer,
            interval_s,
        )
        self.count = 0
        self.at_cap = False
        self.over_peers: set[str] = set()
        self.first_seen: dict[int, int] = {}  # inode -> the census that first saw it
        self.censuses = 0
        self._report = report
        self._tasks = TaskScope()

    def start(self) -> None:
        """A census every `interval_s`; one that fails is logged (once while it fails the
        same way) and the next is tried an interval later."""
        if Path("/proc/net/tcp").exists():
            self._tasks.supervise("connection_count", self._run, pause_s=self.interval_s)

    def observe(self, seen: Census) -> None:
        self.censuses += 1
        self.first_seen = {inode: self.first_seen.get(inode, self.censuses) for inode in seen.seen}
        if self._report is not None:
            self._report(seen.total, sum(seen.over.values()))
        count = self.count = seen.total
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
        for peer, closed in seen.over.items():
            if peer not in self.over_peers:
                log.warning(
                    "connection_per_peer_limit",
                    peer=peer,
                    closed=closed,
                    max_connections_per_peer=self.per_peer,
                )
        self.over_peers = set(seen.over)

    async def _run(self) -> None:
        while True:
            seen = await asyncio.to_thread(census, self.ports, self.per_peer, self.first_seen)
            self.observe(seen)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        await self._tasks.close()
