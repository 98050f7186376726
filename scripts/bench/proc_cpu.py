"""CPU seconds and connections of the processes a benchmark measures, read from /proc
(no extra dependency): one process, a process and its children (the gateway's supervisor
and its serving processes), and how a port's connections spread over processes."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name (field 3 is index 0)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, from /proc (no extra dependency)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from every thread's /proc/PID/task/TID/children."""
    found: set[int] = set()
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                found.update(int(p) for p in (task / "children").read_text().split())
    return sorted(found)


def tree_cpu_seconds(pid: int, seen: set[int] | None = None, depth: int = 0) -> float:
    """CPU of `pid` and its children: its own user + system, what its reaped children
    used (cutime + cstime: a serving process that exits mid-phase stays counted) and
    every live child's tree. `seen` collects the pids visited."""
    try:
        fields = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0  # exited since listed: its time is in its parent's cutime
    if seen is not None:
        seen.add(pid)
    total = sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS
    if depth < 4:
        total += sum(tree_cpu_seconds(child, seen, depth + 1) for child in children(pid))
    return total


def connections_per_process(port: int, pids: list[int]) -> list[int]:
    """Established TCP connections to local `port` held by each of `pids` (how the
    kernel spread the client's connections over the serving processes)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "01" and int(cols[1].rpartition(":")[2], 16) == port:
                    inodes.add(cols[9])
    counts = []
    for pid in pids:
        count = 0
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        count += 1
        counts.append(count)
    return counts


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
