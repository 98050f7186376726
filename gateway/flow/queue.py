"""The waiting room of one model: pure bookkeeping (no awaiting, no clock of its own),
so every ordering rule is a unit test.

Order of service:
- strict priority between classes (index 0 is the highest);
- a request that has waited longer than its class's `starvation_s` is served next,
  ahead of every class (the oldest such first): even while higher classes alone keep
  every worker busy, it waits at most `starvation_s` plus one service time;
- within a class, start-time fair queueing between tenants: each request gets a start
  tag max(class clock, the tenant's last finish) and a finish tag start + cost / weight,
  the smallest start tag is served next and the class clock moves to it. Backlogged
  tenants are served tokens in proportion to their weights, whatever their request
  sizes; a tenant that was idle comes back at the clock, with no credit saved up;
- first come first served within a tenant (its tags only grow).

Bounded: at most `max_requests` waiting and `max_bytes` of their requests. A request
that arrives at a full queue pushes out the newest request of a lower class, else the
newest of the tenant holding the most of its own class (when that is not its own
tenant): a flood fills the queue, but cannot keep a higher class, or a lighter tenant of
the same class, out of it. What is pushed out is answered as a full queue.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FlowClass:
    name: str
    ttl_s: float
    starvation_s: float | None = None


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request. `cost`: its tokens (prompt + max new tokens, or an
    estimate); `size`: its request bytes, counted against the queue's byte bound."""

    tenant: str
    klass: int
    cost: float
    size: int
    since: float
    seq: int = 0
    start: float = 0.0  # start tag within its class (fair queueing)
    finish: float = 0.0
    queued: bool = False


@dataclass(slots=True)
class _Class:
    clock: float = 0.0
    tenants: dict[str, deque[Waiter]] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)  # tenant -> its last finish tag
    arrivals: dict[int, Waiter] = field(default_factory=dict)  # seq -> waiter, oldest first


def _anyone(tenant: str) -> bool:
    return True


class FlowQueue:
    def __init__(
        self,
        classes: Sequence[FlowClass],
        weight: Callable[[str], float],
        max_requests: int,
        max_bytes: int,
    ) -> None:
        self.classes = tuple(classes)
        self._weight = weight
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._state = [_Class() for _ in self.classes]
        self._seq = itertools.count()
        self.count = 0
        self.bytes = 0

    def fits(self, size: int) -> bool:
        """Room for one more request of `size` bytes."""
        return self.count < self.max_requests and self.bytes + size <= self.max_bytes

    def push(self, waiter: Waiter) -> list[Waiter] | None:
        """Queue it: the requests pushed out to make room (most often none), or None if
        there is no room for it."""
        pushed: list[Waiter] = []
        while not self.fits(waiter.size):
            victim = self._victim(waiter)
            if victim is None or waiter.size > self.max_bytes:
                self._undo(pushed)
                return None
            self.remove(victim)
            pushed.append(victim)
        state = self._state[waiter.klass]
        waiter.seq = next(self._seq)
        waiter.start = max(state.clock, state.finish.get(waiter.tenant, 0.0))
        waiter.finish = waiter.start + waiter.cost / max(self._weight(waiter.tenant), 1e-9)
        state.finish[waiter.tenant] = waiter.finish
        state.tenants.setdefault(waiter.tenant, deque()).append(waiter)
        state.arrivals[waiter.seq] = waiter
        waiter.queued = True
        self.count += 1
        self.bytes += waiter.size
        return pushed

    def _victim(self, arrival: Waiter) -> Waiter | None:
        """Whom `arrival` may push out of a full queue: the newest of a lower class (the
        lowest first, its biggest tenant), else the newest of the tenant with the most
        requests of its own class, if that tenant has more than `arrival`'s does."""
        for index in range(len(self.classes) - 1, arrival.klass - 1, -1):
            tenants = self._state[index].tenants
            if not tenants:
                continue
            biggest, line = max(tenants.items(), key=lambda item: len(item[1]))
            if index > arrival.klass:
                return line[-1]
            own = len(tenants.get(arrival.tenant, ()))
            return line[-1] if biggest != arrival.tenant and len(line) > own + 1 else None
        return None

    def _undo(self, pushed: list[Waiter]) -> None:
        """Not enough room even so (bytes): put back what was pushed out, in order."""
        for waiter in pushed:
            self._requeue(waiter)

    def _requeue(self, waiter: Waiter) -> None:
        state = self._state[waiter.klass]
        line = state.tenants.setdefault(waiter.tenant, deque())
        line.append(waiter)
        state.tenants[waiter.tenant] = deque(sorted(line, key=_by_tag))
        state.arrivals[waiter.seq] = waiter
        state.arrivals = dict(sorted(state.arrivals.items()))
        waiter.queued = True
        self.count += 1
        self.bytes += waiter.size

    def remove(self, waiter: Waiter) -> None:
        """Out of the queue without being served (its client went, its time ran out)."""
        if not waiter.queued:
            return
        state = self._state[waiter.klass]
        line = state.tenants[waiter.tenant]
        line.remove(waiter)
        if not line:
            del state.tenants[waiter.tenant]
        self._out(state, waiter)

    def peek(self, now: float, eligible: Callable[[str], bool] = _anyone) -> Waiter | None:
        """The request to serve next, left in the queue; only tenants `eligible` now are
        considered (one at its own in-flight limit waits, the others go on)."""
        starving = [
            found
            for index in range(len(self.classes))
            if (found := self._starving(index, now, eligible)) is not None
        ]
        if starving:
            return min(starving, key=_by_arrival)
        for index in range(len(self.classes)):
            heads = [line[0] for t, line in self._state[index].tenants.items() if eligible(t)]
            if heads:
                return min(heads, key=_by_tag)
        return None

    def pop(self, waiter: Waiter) -> None:
        """`waiter` (from `peek`) is being served."""
        state = self._state[waiter.klass]
        line = state.tenants[waiter.tenant]
        if line[0] is waiter:
            line.popleft()
        else:  # a starving request: the oldest of its class, not its tenant's head
            line.remove(waiter)
        if not line:
            del state.tenants[waiter.tenant]
        state.clock = max(state.clock, waiter.start)
        self._out(state, waiter)

    def expired(self, now: float) -> Iterator[Waiter]:
        """The requests that waited past their class's `ttl_s` (still queued)."""
        for index, flow_class in enumerate(self.classes):
            for waiter in list(self._state[index].arrivals.values()):
                if now - waiter.since < flow_class.ttl_s:
                    break  # arrivals are in order: the rest waited less
                yield waiter

    def depth(self) -> dict[tuple[str, str], int]:
        """(class name, tenant) -> requests waiting."""
        return {
            (self.classes[i].name, tenant): len(line)
            for i, state in enumerate(self._state)
            for tenant, line in state.tenants.items()
        }

    def _starving(self, index: int, now: float, eligible: Callable[[str], bool]) -> Waiter | None:
        """The oldest eligible request of class `index` if it waited its starvation_s."""
        limit = self.classes[index].starvation_s
        if limit is None:
            return None
        for waiter in self._state[index].arrivals.values():
            if now - waiter.since < limit:
                return None  # arrivals are in order: the rest waited less
            if eligible(waiter.tenant):
                return waiter
        return None

    def _out(self, state: _Class, waiter: Waiter) -> None:
        del state.arrivals[waiter.seq]
        waiter.queued = False
        self.count -= 1
        self.bytes -= waiter.size
        if not state.tenants:
            # Idle: the next arrivals start afresh (no tenant keeps credit or debt).
            state.finish.clear()


def _by_tag(waiter: Waiter) -> tuple[float, int]:
    return waiter.start, waiter.seq


def _by_arrival(waiter: Waiter) -> tuple[float, int]:
    return waiter.since, waiter.seq
