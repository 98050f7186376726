"""`processes`: how many serving processes, and the cores this process may use."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

from gateway.config.errors import ConfigError, line_error

MAX_PROCESSES = 64  # serving processes of one gateway


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2, as a container sees it
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1: cpu.cfs_quota_us, cpu.cfs_period_us


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX, v1: Path = CGROUP_V1_CPU) -> int:
    """The cores this process may use: its CPU affinity, capped by a container's CPU
    quota (a Kubernetes CPU limit of 2 on a 64-core node is 2), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cpu_quota(cpu_max, v1)
    return max(1, min(cores, quota) if quota is not None else cores)


def _cpu_quota(cpu_max: Path, v1: Path) -> int | None:
    """The cgroup CPU quota in whole cores (rounded up), or None without one."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
            period = (v1 / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not quota.isdigit() or not period.isdigit() or period == "0":
        return None
    return max(1, -(-int(quota) // int(period)))


def parse_processes(value: Any) -> int:
    """`processes`: a whole number from 1 to MAX_PROCESSES, or `auto` (usable cores)."""
    if value == "auto":
        return min(usable_cores(), MAX_PROCESSES)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROCESSES:
        raise ConfigError(f"processes must be auto or 1..{MAX_PROCESSES}, not {value!r}")
    return value


def _processes(value: Any) -> int:
    try:
        return parse_processes(value)
    except ConfigError as exc:
        raise line_error(str(exc)) from None


# `processes:` in the file: the same check as the flag.
Processes = Annotated[int, BeforeValidator(_processes)]
