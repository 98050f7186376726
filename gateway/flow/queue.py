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
that arrives at a full queue pushes out the newest request of a lower class (the lowest
class first, its tenant with the most waiting first), else the newest of the tenant
holding the most of its own class (when that is not its own tenant and holds more than
its own tenant's + 1): a flood fills the queue, but cannot keep a higher class, or a
lighter tenant of the same class, out of it. What is pushed out is answered as a full
queue. Whether an arrival can be made to fit is decided before anyone is pushed out, and
one arrival pushes out at most `max_pushed` requests (see `MAX_PUSHED_OUT`).

Cost: every operation is O(log n) per request it touches (n: the requests or tenants
waiting), never a scan of the queue: a tenant's line is an insertion-ordered map (FIFO,
any request out in O(1)), and the tenants of a class are ranked in heaps that know where
each tenant sits (by its head's start tag, by its head's age, by how many it has
waiting: `ranking.Ranking`), updated on every change. It runs on the event loop: nothing
here may stall it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.flow.ranking import Ranking, anyone

MAX_PUSHED_OUT = 64
"""At most this many requests are pushed out for one arrival; one that would need more
is refused as a full queue instead. Each request pushed out is answered at once, on the
event loop: the bound keeps what one arrival costs small and fixed, and keeps one big
request from failing a crowd of small ones that queued before it (by the byte bound, a
900 KB request in a queue full of 1 KB ones would otherwise push out 900)."""

_SPENT_SLACK = 8  # `_Class.spent` is rebuilt when it outgrows 2 x the finish tags + this


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
    """One class's requests. Every tenant with a request waiting has a line (its
    requests by seq, oldest first) and a place in each ranking."""

    clock: float = 0.0
    lines: dict[str, OrderedDict[int, Waiter]] = field(default_factory=dict)
    arrivals: OrderedDict[int, Waiter] = field(default_factory=OrderedDict)  # every tenant's
    finish: dict[str, float] = field(default_factory=dict)  # tenant -> its last finish tag
    # (finish, tenant) of each tenant whose line emptied with its finish tag ahead of the
    # clock: the tag is dropped once the clock passes it (max(clock, finish) is the clock
    # from then on: the tag no longer counts).
    spent: list[tuple[float, str]] = field(default_factory=list)
    by_tag: Ranking[tuple[float, int]] = field(default_factory=Ranking)  # head's (start, seq)
    by_age: Ranking[int] = field(default_factory=Ranking)  # head's seq
    by_size: Ranking[tuple[int, int]] = field(default_factory=Ranking)  # (-waiting, head's seq)

    def add(self, waiter: Waiter, weight: float) -> None:
        """Tag `waiter` (it has its seq) and put it at the end of its tenant's line."""
        waiter.start = max(self.clock, self.finish.get(waiter.tenant, 0.0))
        waiter.finish = waiter.start + waiter.cost / max(weight, 1e-9)
        self.finish[waiter.tenant] = waiter.finish
        line = self.lines.get(waiter.tenant)
        new = line is None
        if line is None:
            line = self.lines[waiter.tenant] = OrderedDict()
        line[waiter.seq] = waiter
        self.arrivals[waiter.seq] = waiter
        self._rank(waiter.tenant, line, new_head=new)

    def take(self, waiter: Waiter) -> None:
        """`waiter` out of its line, wherever it stands."""
        line = self.lines[waiter.tenant]
        was_head = next(iter(line)) == waiter.seq
        del line[waiter.seq]
        del self.arrivals[waiter.seq]
        if line:
            self._rank(waiter.tenant, line, new_head=was_head)
            return
        del self.lines[waiter.tenant]
        for ranking in (self.by_tag, self.by_age, self.by_size):
            ranking.discard(waiter.tenant)
        self._retire(waiter.tenant)

    def advance(self, start: float) -> None:
        """A request with start tag `start` is served: the clock moves to it."""
        self.clock = max(self.clock, start)
        while self.spent and self.spent[0][0] <= self.clock:
            _, tenant = heapq.heappop(self.spent)
            if self.finish.get(tenant, self.clock) <= self.clock:  # else it came back
                self.finish.pop(tenant, None)

    def reset(self) -> None:
        """Idle: the next arrivals start afresh (no tenant keeps credit or debt), and no
        table sized for a crowd is kept; only the clock stays."""
        self.lines.clear()
        self.arrivals.clear()
        self.finish.clear()
        self.spent.clear()
        for ranking in (self.by_tag, self.by_age, self.by_size):
            ranking.clear()

    def head(self, tenant: str) -> Waiter:
        return next(iter(self.lines[tenant].values()))

    def next_up(self, eligible: Callable[[str], bool]) -> Waiter | None:
        """The eligible tenants' head with the smallest start tag."""
        tenant = self.by_tag.first(eligible)
        return None if tenant is None else self.head(tenant)

    def starving(self, limit: float, now: float, eligible: Callable[[str], bool]) -> Waiter | None:
        """The oldest eligible request if it waited `limit`: walks the tenants by their
        oldest request, past the ineligible ones (a tenant's oldest is its head)."""
        oldest = self.by_age.first()
        if oldest is None or now - self.head(oldest).since < limit:
            return None  # the most common answer, at once
        for _, tenant in self.by_age.walk():
            head = self.head(tenant)
            if now - head.since < limit:
                return None  # heads are in order: the rest waited less
            if eligible(tenant):
                return head
        return None

    def victims(self, arriving: str | None = None) -> Iterator[Waiter]:
        """Whom to push out of this class, in the order they would go: the newest of
        the tenant with the most waiting (ties: the one holding the oldest request),
        again and again, as if each went. With `arriving` (the arrival's tenant, in its
        own class) only while that tenant is another one holding more than `arriving`'s
        + 1.
        Reads only: each victim costs O(log n)."""
        own = len(self.lines.get(arriving, ())) if arriving is not None else 0
        ranked = self.by_size.walk()
        untouched = next(ranked, None)
        touched: list[tuple[tuple[int, int], str]] = []  # their keys less those yielded
        newest: dict[str, Iterator[Waiter]] = {}
        while touched or untouched is not None:
            if untouched is None or (touched and touched[0][0] < untouched[0]):
                (minus, oldest), tenant = heapq.heappop(touched)
            else:
                (minus, oldest), tenant = untouched
                untouched = next(ranked, None)
                newest[tenant] = reversed(self.lines[tenant].values())
            if arriving is not None and (tenant == arriving or -minus <= own + 1):
                return
            yield next(newest[tenant])
            if minus < -1:
                heapq.heappush(touched, ((minus + 1, oldest), tenant))

    def _rank(self, tenant: str, line: OrderedDict[int, Waiter], new_head: bool) -> None:
        """`tenant`'s line changed (a new head, or only its length): its places."""
        head = next(iter(line.values()))
        if new_head:
            self.by_tag.set(tenant, (head.start, head.seq))
            self.by_age.set(tenant, head.seq)
        self.by_size.set(tenant, (-len(line), head.seq))

    def _retire(self, tenant: str) -> None:
        """`tenant` has none waiting: keep its finish tag only while it is ahead of the
        clock (a tenant that comes back starts at max(clock, finish))."""
        finish = self.finish.get(tenant, self.clock)
        if finish <= self.clock:
            self.finish.pop(tenant, None)
            return
        heapq.heappush(self.spent, (finish, tenant))
        if len(self.spent) > 2 * len(self.finish) + _SPENT_SLACK:  # amortized O(1)
            self.spent = [(f, t) for t, f in self.finish.items() if f > self.clock]
            heapq.heapify(self.spent)


class FlowQueue:
    def __init__(
        self,
        classes: Sequence[FlowClass],
        weight: Callable[[str], float],
        max_requests: int,
        max_bytes: int,
        max_pushed: int = MAX_PUSHED_OUT,
    ) -> None:
        self.classes = tuple(classes)
        self._weight = weight
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.max_pushed = max_pushed
        self._state = [_Class() for _ in self.classes]
        self._seq = itertools.count()
        self.count = 0
        self.bytes = 0

    def fits(self, size: int) -> bool:
        """Room for one more request of `size` bytes."""
        return _fits(self.count, self.bytes, size, self.max_requests, self.max_bytes)

    def push(self, waiter: Waiter) -> list[Waiter] | None:
        """Queue it: the requests pushed out to make room (most often none), or None if
        there is no room for it (then nothing changed)."""
        pushed = [] if self.fits(waiter.size) else self._room_for(waiter)
        if pushed is None:
            return None
        for victim in pushed:
            self.remove(victim)
        waiter.seq = next(self._seq)
        self._state[waiter.klass].add(waiter, self._weight(waiter.tenant))
        waiter.queued = True
        self.count += 1
        self.bytes += waiter.size
        return pushed

    def _room_for(self, arrival: Waiter) -> list[Waiter] | None:
        """Whom `arrival` would push out to fit, decided before anyone goes; None if
        even all it may push out would not make room, or more than `max_pushed` would
        have to go. O(log n) per victim considered, at most `max_pushed` + 1."""
        if arrival.size > self.max_bytes:
            return None
        count, size = self.count, self.bytes
        plan: list[Waiter] = []
        for victim in self._victims(arrival):
            if len(plan) == self.max_pushed:
                return None
            plan.append(victim)
            count, size = count - 1, size - victim.size
            if _fits(count, size, arrival.size, self.max_requests, self.max_bytes):
                return plan
        return None

    def _victims(self, arrival: Waiter) -> Iterator[Waiter]:
        """Whom `arrival` may push out, in order: the lower classes' requests (the
        lowest class first, its biggest tenant first), then its own class's biggest
        tenant's while that is another tenant holding more than its own + 1."""
        for index in range(len(self.classes) - 1, arrival.klass, -1):
            yield from self._state[index].victims()
        yield from self._state[arrival.klass].victims(arriving=arrival.tenant)

    def remove(self, waiter: Waiter) -> None:
        """Out of the queue without being served (its client went, its time ran out)."""
        if waiter.queued:
            self._take(waiter, served=False)

    def peek(self, now: float, eligible: Callable[[str], bool] = anyone) -> Waiter | None:
        """The request to serve next, left in the queue; only tenants `eligible` now are
        considered (one at its own in-flight limit waits, the others go on). O(classes)
        when the first tenant ranked in each class is eligible; otherwise each class also
        walks past its ineligible tenants ranked ahead, O(log j) for the j-th of them."""
        starving = [
            found
            for state, flow_class in zip(self._state, self.classes, strict=True)
            if flow_class.starvation_s is not None
            and (found := state.starving(flow_class.starvation_s, now, eligible)) is not None
        ]
        if starving:
            return min(starving, key=_by_arrival)
        for state in self._state:
            if (found := state.next_up(eligible)) is not None:
                return found
        return None

    def pop(self, waiter: Waiter) -> None:
        """`waiter` (from `peek`) is being served."""
        self._take(waiter, served=True)

    def expired(self, now: float) -> Iterator[Waiter]:
        """The requests that waited past their class's `ttl_s` (still queued): O(1) per
        request named, plus one per class."""
        for state, flow_class in zip(self._state, self.classes, strict=True):
            due: list[Waiter] = []
            for waiter in state.arrivals.values():
                if now - waiter.since < flow_class.ttl_s:
                    break  # arrivals are in order: the rest waited less
                due.append(waiter)
            yield from due

    def depth(self) -> dict[tuple[str, str], int]:
        """(class name, tenant) -> requests waiting."""
        return {
            (self.classes[i].name, tenant): len(line)
            for i, state in enumerate(self._state)
            for tenant, line in state.lines.items()
        }

    def _take(self, waiter: Waiter, served: bool) -> None:
        state = self._state[waiter.klass]
        state.take(waiter)
        if served:
            state.advance(waiter.start)
        if not state.lines:
            state.reset()
        waiter.queued = False
        self.count -= 1
        self.bytes -= waiter.size


def _fits(count: int, size: int, more: int, max_requests: int, max_bytes: int) -> bool:
    return count < max_requests and size + more <= max_bytes


def _by_arrival(waiter: Waiter) -> tuple[float, int]:
    return waiter.since, waiter.seq
