"""Upstream calls: the one way the gateway talks to a worker on a client's behalf.

Every path (regular, each leg of a disaggregated request, each choice of n>1, encoders,
fan-out, fleet-wide forwards, aborts) goes through `Upstreams`, so the accounting is the
same everywhere: it takes each `Reservation` (`proxy/reservation.py`) at placement and
starts each `UpstreamCall` (`proxy/upstream_call.py`) on one, the RPC as `Outbound`
describes it; it cuts the calls of a worker that leaves service, and owns the settles
that outlive a request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core.roles import Role
from gateway.core.tasks import TaskScope
from gateway.observability.tracing import CallTrace, end_leg
from gateway.placement.decision import Decision
from gateway.proxy.failures import label
from gateway.proxy.inflight import AbortKey, InflightCall, InflightTable
from gateway.proxy.metadata import Metadata, MetadataRelay
from gateway.proxy.reservation import Outcomes, Reservation, ReservedPlacement
from gateway.proxy.upstream_call import UpstreamCall
from gateway.upstream.registry import FleetEvent
from gateway.upstream.worker import Worker


@dataclass(frozen=True, slots=True)
class Outbound:
    """One RPC as it goes to a worker: the method, the request as that worker gets it,
    the metadata forwarded, the time left, and whether the answer streams."""

    path: str
    request: bytes
    metadata: Metadata
    timeout: float | None
    streaming: bool = False
    trace: CallTrace | None = None  # tracing on: the call's spans, for this RPC's own
    rank: int | None = None  # the data-parallel rank it runs on, if placement chose one


class Links(Outcomes, Protocol):
    """What upstream calls need of the fleet: each worker's channel, and where to report."""

    def method(self, worker: Worker, path: str, *, streaming: bool) -> Any: ...


class Upstreams:
    """Makes reservations and upstream calls; owns the settles that outlive a request."""

    def __init__(
        self,
        fleet: Links,
        inflight: InflightTable,
        abort_wait_s: float,
        relay: MetadataRelay | None = None,
    ) -> None:
        """`relay`: what of a worker's headers and trailers reaches the client."""
        self.fleet = fleet  # each worker's channel, and where outcomes are reported
        self.inflight = inflight
        self.relay = relay if relay is not None else MetadataRelay()
        self._abort_wait_s = abort_wait_s
        # The tasks of upstream calls (a decode's first read, a prefill's drain, an
        # encoder's answer, a settle waiting for a decode to start): each is cancelled by
        # its call's `close`, and whatever is left when the gateway stops, by `close`.
        # Their outcomes are their calls' business: not logged here.
        self.tasks = TaskScope(log_failures=False)
        self._live: dict[Worker, set[UpstreamCall]] = {}  # each worker's calls not settled

    def reserve(self, worker: Worker, *, judge: bool = True) -> Reservation:
        return Reservation(worker, self.fleet, judge=judge)

    def reserve_all(self, decision: Decision) -> ReservedPlacement:
        """Reserve every worker of a placement at once (call right after placing)."""
        return ReservedPlacement(decision, {w: self.reserve(w) for w in decision.all()})

    def call(
        self,
        reservation: Reservation,
        leg: Role,
        outbound: Outbound,
        *,
        label: str = "",
        hold: AbortKey | None = None,
        until_started: bool = False,
    ) -> UpstreamCall:
        """Start one RPC on a reservation, as the call's `leg`.

        `label` names the worker in a failure's message; `hold` registers the call for
        Abort; `until_started` (decode legs) delays its cancel until its first message,
        bounded, so a KV hand-off is not torn in the middle.
        """
        worker = reservation.worker
        timeout, metadata = outbound.timeout, outbound.metadata
        method = self.fleet.method(worker, outbound.path, streaming=outbound.streaming)
        span = None
        if outbound.trace is not None:
            span, carried = outbound.trace.leg(worker, leg, outbound.rank)
            metadata = (*metadata, *carried)
        try:
            rpc = method(outbound.request, metadata=metadata, timeout=timeout)
        except BaseException:
            reservation.release(None)
            if span is not None:
                end_leg(span, None)
            raise
        holder = None
        if hold is not None:
            started = asyncio.Event() if until_started else None
            holder = InflightCall(reservation.worker, hold.upstream_id, hold.principal, started)
            self.inflight.add(hold.request_id, holder)
        key = hold.request_id if hold is not None else ""
        deadline = None if timeout is None else time.monotonic() + timeout
        call = UpstreamCall(self, reservation, leg, rpc, label, key, holder, deadline, span)
        live = self._live.get(worker)
        if live is None:
            live = self._live[worker] = set()
        live.add(call)
        return call

    def evict(self, worker: Worker, cause: str) -> None:
        """The worker leaves service with calls still running (removed after its drain
        timed out): each is cut, and its failure (UNAVAILABLE, `cause`) is the request's
        to handle, as a stream's worker dying would be: tried again or continued
        elsewhere."""
        for call in self._live.pop(worker, set()):
            call.evict(cause)

    def on_fleet_event(self, event: FleetEvent) -> None:
        """A worker left the registry (removed, or dropped by discovery, after its drain):
        the calls it still has are cut, so each fails over instead of hanging."""
        if event.kind == "removed":
            self.evict(event.worker, "worker_removed")

    def settled(self, call: UpstreamCall) -> None:
        live = self._live.get(call.worker)
        if live is not None:
            live.discard(call)
            if not live:
                del self._live[call.worker]

    def ask(self, reservation: Reservation, outbound: Outbound) -> UpstreamCall:
        """A unary call to one of several workers (a fan-out target, an abort holder):
        its failure names the worker."""
        worker = reservation.worker
        return self.call(reservation, worker.role, outbound, label=label(worker))

    def defer(self, call: UpstreamCall, first: asyncio.Future[Any]) -> None:
        """Settle `call` once `first` is done, bounded (see `UpstreamCall.close`)."""
        self.tasks.spawn(call.settle_after(first, self._abort_wait_s), "settle_after_start")

    async def close(self) -> None:
        """The gateway stops: every upstream call's task still running ends."""
        await self.tasks.close()
