"""What a discovery source reports, and how it is counted.

A source runs for the gateway's lifetime and reports the complete set of hosts it knows
each time it learns it (a resolution, a batch of watch events, a file read). When it
cannot learn (the DNS server is down, the file does not parse, the watch broke) it
reports nothing, so the last set stands: an outage of the source never empties a
cluster. A set larger than the source's `max_hosts` is refused the same way (every host
costs a channel, probes, load polls and metrics series: thousands would take the
gateway down). It counts what it did in its `SourceStats` (its own, written only by it).
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
        if self._outage(error):
            log.warning("discovery_failed", source=self.name, error=error, hosts_kept=self.hosts)

    def too_many(self, hosts: int, max_hosts: int) -> None:
        """An answer of more hosts than the source may report: a failed attempt."""
        if self._outage(f"{hosts} hosts, more than max_hosts {max_hosts}"):
            log.warning(
                "discovery_too_many_hosts",
                source=self.name,
                hosts=hosts,
                max_hosts=max_hosts,
                hosts_kept=self.hosts,
            )

    def _outage(self, error: str) -> bool:
        """Count a failed attempt; True if it starts an outage (then it is logged)."""
        self.errors += 1
        if self.failing:
            return False
        self.failing = error
        return True

    def seconds_since_success(self, now: float) -> float:
        """Since the last report, or since the source started if it never reported."""
        return now - (self.last_success if self.last_success is not None else self._since)


def publish(
    report: Report, stats: SourceStats, hosts: Sequence[Discovered], max_hosts: int
) -> bool:
    """Report a source's whole set of hosts, unless it has more than `max_hosts` (then
    it is refused, counted and logged as a failure: the last set stands). True if
    reported."""
    if len(hosts) > max_hosts:
        stats.too_many(len(hosts), max_hosts)
        return False
    report(hosts)
    stats.succeeded(len(hosts))
    return True


class Source(Protocol):
    """A source of hosts."""

    @property
    def stats(self) -> SourceStats: ...

    async def run(self, report: Report) -> None:
        """Report the whole set of hosts each time it is known, until cancelled."""
