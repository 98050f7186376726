"""What a discovery source reports, and how it is counted.

A source runs for the gateway's lifetime and reports the complete set of hosts it knows
each time it learns it (a resolution, a batch of watch events, a file read). When it
cannot learn (the DNS server is down, the file does not parse, the watch broke) it
reports nothing, so the last set stands: an outage of the source never empties a
cluster. It counts what it did in its `SourceStats` (its own, written only by it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from gateway.config import WorkerSpec

log = structlog.get_logger("gateway.discovery")


@dataclass(frozen=True, slots=True)
class Discovered:
    """One host as a source sees it. `origin`: how the admin API names where it came
    from (`dns:NAME`, `kubernetes:NAMESPACE/POD`, `file:PATH`); `in_service` False: the
    source lists it but says it must take no new calls (a Pod that is not Ready)."""

    spec: WorkerSpec
    origin: str
    in_service: bool = True


Report = Callable[[Sequence[Discovered]], None]


@dataclass(slots=True)
class SourceStats:
    """A source's own account of itself, for metrics and logs."""

    name: str
    hosts: int = 0
    updates: int = 0  # answers that produced a report (resolutions, watch events, reads)
    errors: int = 0
    last_success: float | None = None  # time.monotonic() of the last report
    failing: str = ""  # the current outage's first error ("" while it works)
    _since: float = field(default_factory=time.monotonic)

    def succeeded(self, hosts: int) -> None:
        self.hosts, self.last_success = hosts, time.monotonic()
        self.updates += 1
        if self.failing:
            log.info("discovery_recovered", source=self.name, hosts=hosts)
            self.failing = ""

    def failed(self, error: str) -> None:
        """One failed attempt: counted; logged once per outage (the hosts stay)."""
        self.errors += 1
        if not self.failing:
            self.failing = error
            log.warning("discovery_failed", source=self.name, error=error, hosts_kept=self.hosts)

    def seconds_since_success(self, now: float) -> float:
        """Since the last report, or since the source started if it never reported."""
        return now - (self.last_success if self.last_success is not None else self._since)


class Source(Protocol):
    """A source of hosts."""

    @property
    def stats(self) -> SourceStats: ...

    async def run(self, report: Report) -> None:
        """Report the whole set of hosts each time it is known, until cancelled."""
