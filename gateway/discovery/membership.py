"""Membership: every discovery source's last report, applied to the fleet's one door.

Per address, the reports of every source that lists it decide:
- listed by some source and in service by one of them: a host (joined if new; the
  sources that list it shown as its `sources`);
- listed, but out of service by every source (a Pod not Ready): no new calls at once,
  in-flight ones finish; still so after the longest grace of those sources, it leaves.
  One never in service is not joined at all;
- listed by no source any more: it leaves, unless it is also static (flags, config
  file) or added through the admin API.
A host leaves by the fleet's `remove`: drained (no new calls; in-flight calls, PD pairs
included, finish within `drain.worker_timeout_s`), then forgotten with its KV-index
entries, probes and channel. An address listed again once it left is a fresh host.

Two sources naming one address are one host (the first source's spec is used); a
second spec for the address that names another model is ignored with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import structlog

from gateway.core.tasks import TaskScope, cancel_and_wait
from gateway.discovery.source import Discovered
from gateway.upstream import stagger
from gateway.upstream.manager import Fleet
from gateway.upstream.worker import PERMANENT_SOURCES, Worker

log = structlog.get_logger("gateway.discovery")


class Membership:
    """Applies reports to the fleet. `grace_s`: per source name, how long a host it lists
    may stay out of service before it leaves (sources without one: at once). `spread`:
    how long a host that leaves waits, given how many leave (see gateway/upstream/stagger.py:
    hundreds that leave at once, leave over up to a second)."""

    def __init__(
        self,
        fleet: Fleet,
        drain_timeout_s: float,
        grace_s: Mapping[str, float] | None = None,
        spread: Callable[[int], float] = stagger.spread,
    ) -> None:
        self._fleet = fleet
        self._spread = spread
        self._drain_timeout_s = drain_timeout_s
        self._grace_s = dict(grace_s or {})
        self._claims: dict[str, dict[str, Discovered]] = {}  # source -> address -> host
        self._reported: dict[str, asyncio.Event] = {}  # source -> it reported once
        self._joining: dict[str, asyncio.Task[None]] = {}
        self._leaving: dict[str, asyncio.Task[bool]] = {}  # their tasks are this scope's:
        self._tasks = TaskScope()
        self._expiry: dict[str, asyncio.TimerHandle] = {}  # out of service: leaves then
        # address -> the sources warned of naming another model there, while they do:
        # never more than the claims themselves (each source's bounded by its max_hosts).
        self._warned: dict[str, set[str]] = {}
        self._closed = False

    # -- reports ------------------------------------------------------------------------

    def apply(self, source: str, hosts: Sequence[Discovered]) -> None:
        """`source`'s whole set of hosts now."""
        if self._closed:
            return
        listed: dict[str, Discovered] = {}
        for host in hosts:
            listed.setdefault(host.spec.address, host)
        before = self._claims.get(source, {})
        self._claims[source] = listed
        for address in sorted(before.keys() | listed.keys()):
            self._settle(address)
        self._event(source).set()

    def claims(self) -> dict[str, list[Discovered]]:
        """Every source's last report (for a serving process that starts later)."""
        return {source: list(hosts.values()) for source, hosts in self._claims.items()}

    async def first_reports(self, sources: Iterable[str], timeout_s: float) -> bool:
        """Wait (bounded) until each source reported once and the hosts it named have a
        first probe verdict: start-up says READY with them. True if all in time."""
        deadline = time.monotonic() + timeout_s
        waits = [self._event(source).wait() for source in sources]
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*waits)
        except TimeoutError:
            return False
        joins = list(self._joining.values())
        if joins:
            _, pending = await asyncio.wait(joins, timeout=max(0.0, deadline - time.monotonic()))
            return not pending
        return True

    async def close(self) -> None:
        self._closed = True
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()
        # The joins are the fleet's tasks: ended here too, so none settles after the close.
        await cancel_and_wait([*self._joining.values()])
        await self._tasks.close()

    # -- one address ----------------------------------------------------------------------

    def _event(self, source: str) -> asyncio.Event:
        event = self._reported.get(source)
        if event is None:
            event = self._reported[source] = asyncio.Event()
        return event

    def _settle(self, address: str) -> None:
        if self._closed or address in self._leaving:
            return  # settled again when that ends
        claims = [hosts[address] for hosts in self._claims.values() if address in hosts]
        self._forget_warnings(address, claims)
        joining = self._joining.get(address)
        if joining is not None:
            # Still asking the worker what it is (or waiting for its first probe): a
            # source that dropped it meanwhile ends the wait; else settled once it ends.
            if not any(c.in_service for c in claims):
                joining.cancel()
            return
        fleet = self._fleet
        worker = fleet.registry.get(address)
        if worker is None:
            if claims and any(c.in_service for c in claims) and not fleet.has(address):
                self._join(address, claims)
            return
        permanent = tuple(s for s in worker.sources if s in PERMANENT_SOURCES)
        if not claims:
            self._cancel_expiry(address)
            if permanent:
                fleet.name(worker, permanent)
                fleet.set_in_service(worker, True, "discovery: static")
            else:
                self._leave(worker, "no source lists it")
            return
        claims = [c for c in claims if self._same_model(worker, c)]
        if not claims:
            return
        fleet.name(worker, tuple(sorted({*permanent, *(c.origin for c in claims)})))
        if permanent or any(c.in_service for c in claims):
            self._cancel_expiry(address)
            fleet.set_in_service(worker, True, f"discovery: {claims[0].origin} in service")
            return
        fleet.set_in_service(worker, False, f"discovery: {claims[0].origin} out of service")
        if address not in self._expiry:
            grace = max(self._grace_s.get(source, 0.0) for source in self._sources_of(address))
            loop = asyncio.get_running_loop()
            self._expiry[address] = loop.call_later(grace, self._expire, address)

    def _sources_of(self, address: str) -> list[str]:
        return [source for source, hosts in self._claims.items() if address in hosts]

    def _same_model(self, worker: Worker, claim: Discovered) -> bool:
        model = claim.spec.model
        if model is None or model == worker.model:
            return True
        warned = self._warned.setdefault(worker.id, set())
        if claim.origin not in warned:
            warned.add(claim.origin)
            log.warning(
                "discovery_conflict",
                worker=worker.id,
                model=worker.model,
                source=claim.origin,
                source_model=model,
            )
        return False

    def _forget_warnings(self, address: str, claims: list[Discovered]) -> None:
        """A conflict ends when its source stops naming the address (warned again if it
        comes back): the warnings kept are those of claims that still stand."""
        warned = self._warned.get(address)
        if warned is None:
            return
        warned &= {c.origin for c in claims}
        if not warned:
            del self._warned[address]

    def _join(self, address: str, claims: list[Discovered]) -> None:
        origins = tuple(sorted({c.origin for c in claims}))
        task = self._fleet.join(claims[0].spec, origins)
        self._joining[address] = task
        log.info("discovery_join", worker=address, sources=list(origins))

        def joined(_: asyncio.Task[None]) -> None:
            if self._joining.get(address) is task:
                del self._joining[address]
                self._settle(address)  # what the sources said meanwhile

        task.add_done_callback(joined)

    def _expire(self, address: str) -> None:
        self._expiry.pop(address, None)
        worker = self._fleet.registry.get(address)
        if worker is not None and not worker.in_service:
            self._leave(worker, "out of service past its grace")

    def _cancel_expiry(self, address: str) -> None:
        timer = self._expiry.pop(address, None)
        if timer is not None:
            timer.cancel()

    def _leave(self, worker: Worker, why: str) -> None:
        address = worker.id
        self._cancel_expiry(address)
        task = self._tasks.spawn(self._remove(worker, why), "discovery_leave", worker=address)
        self._leaving[address] = task

        def left(_: asyncio.Task[bool]) -> None:
            if self._leaving.get(address) is task:
                del self._leaving[address]
            with contextlib.suppress(RuntimeError):  # the loop may be closing
                self._settle(address)  # listed again meanwhile: a fresh host

        task.add_done_callback(left)

    async def _remove(self, worker: Worker, why: str) -> bool:
        """Drain and forget the worker, once its turn among those leaving comes."""
        await asyncio.sleep(self._spread(len(self._leaving)))
        log.info("discovery_leave", worker=worker.id, why=why)
        return await self._fleet.remove(worker, self._drain_timeout_s)
