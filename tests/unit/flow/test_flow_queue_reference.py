"""The waiting room against a plain reference model of its rules (pure: no clock, no awaiting):
for any sequence of arrivals, services, removals and waits (hypothesis), the queue serves,
pushes out and expires what the reference does."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flow.queue import FlowClass, FlowQueue, Waiter
from tests.support.queues import held


class Reference:
    """The rules of the module docstring as plainly as they can be written: the queue is
    one list in arrival order, every decision a scan of it. Slow, and obviously so."""

    def __init__(self, q: FlowQueue) -> None:
        self.q = q  # its settings only
        self.queued: list[Waiter] = []
        self.clock = [0.0 for _ in q.classes]
        self.finish: list[dict[str, float]] = [{} for _ in q.classes]
        self.seq = 0

    def lines(self, queued: list[Waiter], klass: int) -> dict[str, list[Waiter]]:
        """Tenant -> its calls of `klass`, tenants in the order of their oldest call."""
        found: dict[str, list[Waiter]] = {}
        for w in queued:
            if w.klass == klass:
                found.setdefault(w.tenant, []).append(w)
        return found

    def victim(self, queued: list[Waiter], arrival: Waiter) -> Waiter | None:
        for klass in range(len(self.q.classes) - 1, arrival.klass - 1, -1):
            lines = self.lines(queued, klass)
            if not lines:
                continue
            biggest = max(lines, key=lambda t: len(lines[t]))  # ties: the first
            if klass > arrival.klass:
                return lines[biggest][-1]
            own = len(lines.get(arrival.tenant, []))
            mine = biggest == arrival.tenant
            return lines[biggest][-1] if not mine and len(lines[biggest]) > own + 1 else None
        return None

    def push(self, w: Waiter) -> list[Waiter] | None:
        left = list(self.queued)
        pushed: list[Waiter] = []
        q = self.q
        while not (
            len(left) < q.max_requests and sum(v.size for v in left) + w.size <= q.max_bytes
        ):
            victim = self.victim(left, w)
            if victim is None or w.size > q.max_bytes or len(pushed) == q.max_pushed:
                return None
            left.remove(victim)
            pushed.append(victim)
        for victim in pushed:
            self.out(victim)
        w.seq, self.seq = self.seq, self.seq + 1
        w.start = max(self.clock[w.klass], self.finish[w.klass].get(w.tenant, 0.0))
        w.finish = w.start + w.cost / max(q._weight(w.tenant), 1e-9)
        self.finish[w.klass][w.tenant] = w.finish
        self.queued.append(w)
        return pushed

    def peek(self, now: float, eligible: Callable[[str], bool]) -> Waiter | None:
        starving = []
        for klass, flow_class in enumerate(self.q.classes):
            for w in (v for v in self.queued if v.klass == klass):
                if flow_class.starvation_s is None or now - w.since < flow_class.starvation_s:
                    break
                if eligible(w.tenant):
                    starving.append(w)
                    break
        if starving:
            return min(starving, key=lambda w: (w.since, w.seq))
        for klass in range(len(self.q.classes)):
            heads = [line[0] for t, line in self.lines(self.queued, klass).items() if eligible(t)]
            if heads:
                return min(heads, key=lambda w: (w.start, w.seq))
        return None

    def pop(self, w: Waiter) -> None:
        self.clock[w.klass] = max(self.clock[w.klass], w.start)
        self.out(w)

    def out(self, w: Waiter) -> None:
        self.queued.remove(w)
        if not any(v.klass == w.klass for v in self.queued):
            self.finish[w.klass].clear()

    def expired(self, now: float) -> list[Waiter]:
        return [
            w
            for klass, flow_class in enumerate(self.q.classes)
            for w in self.queued
            if w.klass == klass and now - w.since >= flow_class.ttl_s
        ]


TENANTS = ("a", "b", "c", "d")
PUSH = st.tuples(
    st.just("push"),
    st.sampled_from(TENANTS),
    st.integers(0, 2),
    st.sampled_from([0.0, 1.0, 7.0, 100.0, 1000.0]),
    st.integers(1, 40),
)
SERVE = st.tuples(st.just("serve"), st.frozensets(st.sampled_from(TENANTS)))
REMOVE = st.tuples(st.just("remove"), st.integers(0, 1000))
WAIT = st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 11.0]))


class Twins:
    """The queue and the reference, given the same steps; `check` compares them."""

    def __init__(self, q: FlowQueue) -> None:
        self.q = q
        self.ref = Reference(q)
        self.twin: dict[Waiter, Waiter] = {}  # the queue's waiter -> the reference's
        self.now = 0.0

    def push(self, tenant: str, klass: int, cost: float, size: int) -> None:
        mine, theirs = (Waiter(tenant, klass, cost, size, self.now) for _ in range(2))
        pushed, expected = self.q.push(mine), self.ref.push(theirs)
        if pushed is None or expected is None:
            assert pushed is expected is None
            return
        assert [self.twin[w] for w in pushed] == expected
        self.twin[mine] = theirs
        assert (mine.seq, mine.start, mine.finish) == (theirs.seq, theirs.start, theirs.finish)

    def serve(self, eligible: frozenset[str]) -> None:
        chosen = self.q.peek(self.now, eligible.__contains__)
        expected = self.ref.peek(self.now, eligible.__contains__)
        assert (self.twin[chosen] if chosen is not None else None) is expected
        if chosen is not None and expected is not None:
            self.q.pop(chosen)
            self.ref.pop(expected)

    def remove(self, which: int) -> None:
        """Any call ever pushed: one gone already is a no-op."""
        if self.twin:
            mine, theirs = list(self.twin.items())[which % len(self.twin)]
            self.q.remove(mine)
            if theirs in self.ref.queued:
                self.ref.out(theirs)

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def check(self) -> None:
        q, queued = self.q, self.ref.queued
        assert [self.twin[w] for w in q.expired(self.now)] == self.ref.expired(self.now)
        assert q.depth() == dict(
            Counter((q.classes[w.klass].name, w.tenant) for w in queued).items()
        )
        assert (q.count, q.bytes) == (len(queued), sum(w.size for w in queued))


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(st.one_of(PUSH, PUSH, SERVE, REMOVE, WAIT), min_size=20, max_size=100),
    max_requests=st.integers(1, 10),
    max_pushed=st.integers(0, 4),
)
def test_the_queue_decides_as_the_plain_reference_does(
    ops: list[tuple[Any, ...]], max_requests: int, max_pushed: int
) -> None:
    """Random pushes, serves (some tenants not eligible), removals and waits: every
    answer, every tag and the depths are the reference's; once all is gone, the
    queue's tables are empty."""
    classes = (
        FlowClass("interactive", ttl_s=30),
        FlowClass("standard", ttl_s=20, starvation_s=25),
        FlowClass("batch", ttl_s=60, starvation_s=10),
    )
    weights = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 0.0}
    q = FlowQueue(classes, weights.__getitem__, max_requests, 120, max_pushed=max_pushed)
    twins = Twins(q)
    steps: dict[str, Callable[..., None]] = {
        "push": twins.push,
        "serve": twins.serve,
        "remove": twins.remove,
        "wait": twins.wait,
    }
    for name, *args in ops:
        steps[name](*args)
        twins.check()
    for w in list(twins.twin):
        q.remove(w)
    assert held(q) == 0
