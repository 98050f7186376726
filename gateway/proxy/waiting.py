"""Waiting rooms: with `flow:` configured, a request that finds every worker of its model
at its limits waits in the model's queue (gateway/flow/queue.py) instead of being refused.

- A request waits when placement says WORKERS_OVERLOADED, when others of its model
  that could run already wait (no overtaking), or when its tenant has its `max_inflight`
  calls in flight (it is served once one of them ends; other tenants go on meanwhile).
  Any other verdict (no worker at all, none available) is answered at once: a
  deployment gap is not waited on.
- Whenever capacity may have come free (a reservation released, a worker's status
  changed) the room serves from its head: it places the head request and reserves its
  workers in the same step (no await in between, as everywhere), then hands the
  reservation to the waiting call, which runs it as its first attempt. It stops at the
  first head that still does not fit.
- A request that waits past its class's `ttl_s` is QUEUE_TIMEOUT; a full queue is
  QUEUE_FULL; the client's own deadline or cancel takes it out of the queue, and nothing
  was sent upstream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config import FlowConfig, TenantConfig
from gateway.core import verdicts
from gateway.core.verdicts import Reason, Verdict
from gateway.flow.queue import FlowClass, FlowQueue, Waiter
from gateway.placement.decision import Decision
from gateway.proxy.call import Place
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.upstream import Upstreams

MAX_SHOWN_MODELS = 1024  # models whose queue depth is shown at 0 once empty


@dataclass(eq=False, slots=True)
class Ticket:
    """A request in a waiting room: its place in the queue, how to place it, and where
    its reservation goes."""

    waiter: Waiter
    place: Place
    answer: asyncio.Future[ReservedPlacement | Verdict] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def classes_of(settings: FlowConfig) -> tuple[FlowClass, ...]:
    return tuple(FlowClass(c.name, c.ttl_s, c.starvation_s) for c in settings.classes)


def in_queue(queue: FlowQueue, classes: tuple[FlowClass, ...], klass: int) -> int:
    """A call's class (its index in `classes`, the classes now) in `queue`'s own list:
    the same, unless a reload changed the classes while the queue had calls waiting;
    then found by name (a class the queue lacks: its lowest)."""
    if queue.classes is classes:
        return klass
    name = classes[min(klass, len(classes) - 1)].name
    own = [c.name for c in queue.classes]
    return own.index(name) if name in own else len(own) - 1


class ModelQueue:
    """One model's queue and the calls waiting in it."""

    def __init__(self, model: str, queue: FlowQueue) -> None:
        self.model = model
        self.queue = queue
        self.tickets: dict[Waiter, Ticket] = {}
        self.due = False  # a serve pass is scheduled


class WaitingRooms:
    def __init__(
        self,
        settings: FlowConfig,
        tenant: Callable[[str], TenantConfig],
        upstreams: Upstreams,
        retry_after_ms: int,
    ) -> None:
        self.settings = settings
        self.classes = classes_of(settings)
        self._tenant = tenant
        self._inflight: dict[str, int] = {}  # tenant -> its admitted calls not yet done
        self._upstreams = upstreams
        self._retry_after_ms = retry_after_ms
        self._rooms: dict[str, ModelQueue] = {}
        # Models that had a queue, for the depth series (0 when empty, not absent); only
        # placeable models reach a queue, and at most MAX_SHOWN_MODELS are kept.
        self._shown: dict[str, None] = {}

    def configure(self, settings: FlowConfig, retry_after_ms: int) -> None:
        """A reload: the classes, bounds and retry hint from the next call on. A queue
        with calls waiting keeps them all: its bounds change at once, its classes too
        when their names are the same; else it keeps its own until it empties."""
        self.settings, self.classes = settings, classes_of(settings)
        self._retry_after_ms = retry_after_ms
        names = [c.name for c in self.classes]
        for room in self._rooms.values():
            queue = room.queue
            queue.max_requests = settings.queue.max_requests
            queue.max_bytes = settings.queue.max_bytes
            if [c.name for c in queue.classes] == names:
                queue.classes = self.classes

    def by_tenant(self) -> dict[tuple[str, str, str], int]:
        """(model, class, tenant) -> calls waiting."""
        return {
            (model, klass, tenant): count
            for model, room in list(self._rooms.items())
            for (klass, tenant), count in room.queue.depth().items()
        }

    def depth(self) -> dict[tuple[str, str], int]:
        """(model, class) -> calls waiting, every class of every model that had a queue
        (0 when empty: a dashboard shows 0, not "no data")."""
        found = {(model, c.name): 0 for model in list(self._shown) for c in self.classes}
        for (model, klass, _tenant), count in self.by_tenant().items():
            found[(model, klass)] = found.get((model, klass), 0) + count
        return found

    def queued_bytes(self) -> dict[str, int]:
        found = dict.fromkeys(list(self._shown), 0)
        found.update((model, room.queue.bytes) for model, room in list(self._rooms.items()))
        return found

    def waiting(self, model: str) -> int:
        room = self._rooms.get(model)
        return room.queue.count if room is not None else 0

    async def admit(
        self, model: str, tenant: str, klass: int, cost: float, size: int, place: Place
    ) -> ReservedPlacement | Verdict:
        """Placed and reserved now, placed and reserved once capacity frees, or the
        verdict (not overloaded, QUEUE_FULL, QUEUE_TIMEOUT). Cancelled (the client went or
        its deadline passed): out of the queue, nothing reserved."""
        room = self._rooms.get(model)
        # Nobody that could run waits ahead (those held by their tenant's own limit do
        # not count): try at once.
        ahead = room is not None and room.queue.peek(time.monotonic(), self._may_run)
        if not ahead and self._may_run(tenant):
            placed = place(())
            if isinstance(placed, Decision):
                return self._start(tenant, placed)
            if placed.reason is not Reason.WORKERS_OVERLOADED:
                return placed
        room = self._room(model)
        queue = room.queue
        klass = in_queue(queue, self.classes, klass)
        waiter = Waiter(tenant, klass, cost, size, time.monotonic())
        waiting = queue.count  # the answer, if any, says the queue as it was before
        pushed = queue.push(waiter)
        if pushed is None:
            return self._full(model, queue, waiting)
        if pushed:  # made room for a higher class or a lighter tenant
            full = self._full(model, queue, waiting)
            for victim in pushed:
                room.tickets[victim].answer.set_result(full)
        ticket = Ticket(waiter, place)
        room.tickets[waiter] = ticket
        ttl = queue.classes[klass].ttl_s
        try:
            async with asyncio.timeout(ttl):
                return await asyncio.shield(ticket.answer)
        except TimeoutError:
            if ticket.answer.done():  # served in the same instant: it is ours
                return ticket.answer.result()
            waited = time.monotonic() - waiter.since
            name = queue.classes[klass].name
            return verdicts.queue_timeout(model, name, waited, self._retry_after_ms)
        except asyncio.CancelledError:
            # The client went (or its deadline passed): a reservation made for it in the
            # same instant goes back unused.
            answer = ticket.answer
            if answer.done() and not answer.cancelled():
                taken = answer.result()
                if isinstance(taken, ReservedPlacement):
                    taken.release_unused()
                    self.done(tenant)
            raise
        finally:
            self._leave(room, ticket)

    def done(self, tenant: str) -> None:
        """An admitted call of `tenant` ended: it may run another (any model's queue)."""
        left = self._inflight.get(tenant, 0) - 1
        if left > 0:
            self._inflight[tenant] = left
        else:
            self._inflight.pop(tenant, None)
        if self._tenant(tenant).max_inflight is not None:
            for model in list(self._rooms):
                self.kick(model)

    def _may_run(self, tenant: str) -> bool:
        limit = self._tenant(tenant).max_inflight
        return limit is None or self._inflight.get(tenant, 0) < limit

    def _start(self, tenant: str, decision: Decision) -> ReservedPlacement:
        """An admitted call of `tenant`: its workers reserved, counted against its tenant."""
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        return self._upstreams.reserve_all(decision)

    def shut(self) -> int:
        """The drain ends: every call still queued is answered SHUTTING_DOWN (UNAVAILABLE,
        with RetryInfo) rather than cut off; returns how many."""
        answered = 0
        for model, room in list(self._rooms.items()):
            verdict = verdicts.shutting_down(model, self._retry_after_ms)
            for ticket in list(room.tickets.values()):
                if ticket.waiter.queued and not ticket.answer.done():
                    room.queue.remove(ticket.waiter)
                    ticket.answer.set_result(verdict)
                    answered += 1
        return answered

    def _full(self, model: str, queue: FlowQueue, waiting: int) -> Verdict:
        """QUEUE_FULL for a queue that held `waiting` calls (built only when answered)."""
        limit = (
            f"flow.queue.max_requests {queue.max_requests}"
            if waiting >= queue.max_requests
            else f"flow.queue.max_bytes {queue.max_bytes}"
        )
        return verdicts.queue_full(model, waiting, limit, self._retry_after_ms)

    def kick(self, model: str) -> None:
        """Capacity for `model` may have come free: serve its queue soon (once per burst)."""
        room = self._rooms.get(model)
        if room is None or room.due or not room.queue.count:
            return
        room.due = True
        asyncio.get_running_loop().call_soon(self._serve, room)

    def _room(self, model: str) -> ModelQueue:
        room = self._rooms.get(model)
        if room is None:
            queue = FlowQueue(
                self.classes,
                lambda tenant: self._tenant(tenant).weight,
                self.settings.queue.max_requests,
                self.settings.queue.max_bytes,
            )
            room = self._rooms[model] = ModelQueue(model, queue)
            if model not in self._shown and len(self._shown) < MAX_SHOWN_MODELS:
                self._shown[model] = None
        return room

    def _serve(self, room: ModelQueue) -> None:
        room.due = False
        queue = room.queue
        while (waiter := queue.peek(time.monotonic(), self._may_run)) is not None:
            ticket = room.tickets[waiter]
            placed = ticket.place(())
            if isinstance(placed, Verdict) and placed.reason is Reason.WORKERS_OVERLOADED:
                return  # still full: the next release tries again
            queue.pop(waiter)
            if isinstance(placed, Decision):
                ticket.answer.set_result(self._start(waiter.tenant, placed))
            else:
                ticket.answer.set_result(placed)
        self._close_if_empty(room)  # its last calls may have left while this pass was due

    def _leave(self, room: ModelQueue, ticket: Ticket) -> None:
        """The call stopped waiting (served, timed out, cancelled)."""
        room.queue.remove(ticket.waiter)
        room.tickets.pop(ticket.waiter, None)
        if not ticket.answer.done():
            ticket.answer.cancel()
        self._close_if_empty(room)

    def _close_if_empty(self, room: ModelQueue) -> None:
        """A room lives only while calls wait in it or a serve pass for it is due: an
        empty one goes, and its queue with it."""
        empty = not room.queue.count and not room.tickets and not room.due
        if empty and self._rooms.get(room.model) is room:
            del self._rooms[room.model]
