"""A job: one client call, or one choice of an n>1 call, as dispatch places and runs it,
and the one place where any of its legs is opened (regular calls, and every PD/EPD leg),
or handed to someone else to open (the picker's: Envoy calls the worker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from gateway.core.roles import Role
from gateway.engines import EngineAdapter
from gateway.observability.record import CallRecord
from gateway.placement.decision import Decision
from gateway.proxy.call import Call
from gateway.proxy.context import Context
from gateway.proxy.inflight import AbortKey, InflightCall
from gateway.proxy.reservation import Reservation, ReservedPlacement
from gateway.proxy.upstream import Outbound, Upstreams
from gateway.proxy.upstream_call import Sink, UpstreamCall
from gateway.upstream.worker import Worker


@dataclass(frozen=True, slots=True)
class Job:
    """One client call, or one choice of an n>1 call, to place and run: the call, and
    what this part of it sends (its own request bytes and id) and where its answer goes."""

    call: Call
    adapter: EngineAdapter
    raw: bytes
    sink: Sink
    upstream_id: str  # the id the workers know it by: the client's, `<id>-<i>`, `<id>~<k>`
    return_logprob: bool = False
    choices: int = 1  # the choices its one upstream stream carries (n, unless split)

    @property
    def context(self) -> Context:
        return self.call.context

    @property
    def record(self) -> CallRecord:
        return self.call.record

    def outbound(
        self, request: bytes, *, streaming: bool, path: str | None = None, rank: int | None = None
    ) -> Outbound:
        """`request` as an RPC to a worker: the call's method (or `path`), its forwarded
        metadata and the client's time left (`rank`: the data-parallel rank it runs on)."""
        call = self.call
        return Outbound(
            path or call.spec.path,
            request,
            call.meta.forward,
            call.context.time_remaining(),
            streaming,
            call.trace,
            rank,
        )

    def for_worker(self, request: bytes, decision: Decision, worker: Worker) -> bytes:
        """The request as `worker` gets it: on the data-parallel rank placement chose."""
        rank = decision.rank_of(worker)
        return request if rank is None else self.adapter.with_dp_rank(request, rank)

    def hold(self) -> AbortKey:
        record = self.call.record
        return AbortKey(record.request_id, self.upstream_id, record.principal)

    def open_leg(
        self,
        upstreams: Upstreams,
        reserved: ReservedPlacement,
        worker: Worker,
        leg: Role,
        request: bytes,
        *,
        streaming: bool = True,
        path: str | None = None,
        label: str = "",
        answers: bool = False,
        until_started: bool = False,
    ) -> UpstreamCall:
        """The one place a leg is opened, for regular calls and every PD/EPD leg: the
        upstream call on the worker's reservation, noted on the call (`answers`: its
        stream is the client's); a streamed engine call (not an encoder's) can be
        aborted; `until_started` (a decode leg): cancelled only once it has started."""
        self.call.called(leg, worker.id, answers=answers)
        encoder = leg is Role.ENCODE  # encoders do not speak the engine protocol
        return upstreams.call(
            reserved.take(worker),
            leg,
            self.outbound(
                request, streaming=streaming, path=path, rank=reserved.decision.rank_of(worker)
            ),
            label=label,
            hold=None if encoder or not streaming else self.hold(),
            until_started=until_started,
        )

    @contextlib.contextmanager
    def handed_over(
        self, upstreams: Upstreams, reserved: ReservedPlacement, worker: Worker
    ) -> Iterator[Reservation]:
        """A leg someone else opens (Envoy, told by the picker): noted on the call as its
        answering leg, and held in flight under the call's id while it runs, so an Abort
        finds it. The worker's reservation is the caller's to give back, once it learns
        how the leg ended."""
        self.call.called(worker.role, worker.id, answers=True)
        holder = InflightCall(worker, self.upstream_id, self.call.record.principal, direct=True)
        reservation = reserved.take(worker)
        upstreams.inflight.add(self.upstream_id, holder)
        try:
            yield reservation
        finally:
            upstreams.inflight.discard(self.upstream_id, holder)
