"""The waiting room's order of service, rule by rule (pure: no clock, no awaiting)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flow.queue import MAX_PUSHED_OUT, FlowClass, FlowQueue, Waiter
from tests.support.queues import CLASSES


def queue(weights: dict[str, float] | None = None, max_requests: int = 10_000) -> FlowQueue:
    table = weights or {}
    return FlowQueue(CLASSES, lambda t: table.get(t, 1.0), max_requests, max_bytes=1 << 30)


def waiter(tenant: str, klass: int = 1, cost: float = 100, since: float = 0.0) -> Waiter:
    return Waiter(tenant, klass, cost, size=10, since=since)


def serve(q: FlowQueue, now: float = 0.0) -> Waiter:
    chosen = q.peek(now)
    assert chosen is not None
    q.pop(chosen)
    return chosen


def test_strict_priority_between_classes() -> None:
    q = queue()
    batch, standard, interactive = waiter("a", 2), waiter("a", 1), waiter("b", 0)
    for w in (batch, standard, interactive):
        assert q.push(w) == []
    assert [serve(q) for _ in range(3)] == [interactive, standard, batch]
    assert q.peek(0.0) is None and q.count == 0 and q.bytes == 0


def test_first_come_first_served_within_a_tenant() -> None:
    q = queue()
    mine = [waiter("a", cost=c) for c in (500, 1, 50)]
    for w in mine:
        q.push(w)
    assert [serve(q) for _ in mine] == mine


def test_backlogged_tenants_get_equal_tokens_whatever_they_offer() -> None:
    """Two tenants offering 10:1 (ten times the requests), both always backlogged: the
    tokens served split in half (within 10%)."""
    q = queue()
    served: Counter[str] = Counter()
    for _ in range(200):
        for _ in range(10):
            q.push(waiter("heavy", cost=100))
        q.push(waiter("light", cost=100))
        for _ in range(2):
            w = serve(q)
            served[w.tenant] += int(w.cost)
    total = sum(served.values())
    assert abs(served["light"] / total - 0.5) <= 0.05, served


def test_weights_split_tokens_in_their_ratio_with_mixed_request_sizes() -> None:
    """Weight 2:1, requests of 1000 and 100 tokens: tokens served 2:1 (within 10%)."""
    q = queue({"gold": 2.0, "basic": 1.0})
    tokens: Counter[str] = Counter()
    for _ in range(30):
        for _ in range(20):
            q.push(waiter("gold", cost=1000))
            q.push(waiter("basic", cost=100))
    for _ in range(300):  # both still backlogged after this
        w = serve(q)
        tokens[w.tenant] += int(w.cost)
    assert abs(tokens["gold"] / tokens["basic"] - 2.0) <= 0.2, tokens


def test_an_idle_tenant_comes_back_without_saved_credit() -> None:
    q = queue()
    for _ in range(50):
        q.push(waiter("busy"))
    for _ in range(40):
        serve(q)
    late = [waiter("late") for _ in range(5)]
    for w in late:
        q.push(w)
    order = [serve(q).tenant for _ in range(10)]
    # Alternates from now on; "late" did not get its 40 missed turns in a row.
    assert order.count("late") == 5 and order[:2] in (["late", "busy"], ["busy", "late"])
    assert order != ["late"] * 5 + ["busy"] * 5


def test_a_starving_request_is_served_next_ahead_of_every_class() -> None:
    q = queue()
    old_batch = waiter("b", klass=2, since=0.0)
    q.push(old_batch)
    for i in range(3):
        q.push(waiter("s", klass=1, since=float(i)))
        q.push(waiter("i", klass=0, since=float(i)))
    assert serve(q, now=59.0).klass == 0  # not starving yet: strict priority
    # Waited starvation_s: ahead even of interactive, which alone would keep it waiting.
    assert serve(q, now=60.0) is old_batch
    assert serve(q, now=60.0).klass == 0


def test_the_queue_is_bounded_in_requests_and_bytes() -> None:
    q = FlowQueue(CLASSES, lambda t: 1.0, max_requests=2, max_bytes=25)
    assert q.push(waiter("a")) == [] and q.push(waiter("a")) == []
    assert q.push(waiter("a")) is None  # count
    serve(q)
    big = Waiter("a", 1, 1, size=16, since=0)
    assert q.push(big) is None  # 10 + 16 > 25 bytes
    assert q.push(Waiter("a", 1, 1, size=15, since=0)) == []
    assert (q.count, q.bytes) == (2, 25)


def test_expired_names_what_waited_past_its_class_ttl() -> None:
    q = queue()
    early, late = waiter("a", klass=0, since=0.0), waiter("a", klass=0, since=10.0)
    slow = waiter("a", klass=1, since=0.0)
    for w in (early, late, slow):
        q.push(w)
    assert list(q.expired(29.9)) == []
    assert list(q.expired(30.0)) == [early]
    assert list(q.expired(60.0)) == [early, late, slow]
    q.remove(early)
    assert list(q.expired(40.0)) == [late] and q.count == 2
    q.remove(early)  # twice: nothing
    assert q.count == 2


def test_depth_by_class_and_tenant() -> None:
    q = queue()
    for tenant, klass in (("a", 0), ("a", 0), ("b", 2)):
        q.push(waiter(tenant, klass))
    assert q.depth() == {("interactive", "a"): 2, ("batch", "b"): 1}


def test_a_full_queue_makes_room_for_a_higher_class_and_a_lighter_tenant() -> None:
    q = FlowQueue(CLASSES, lambda t: 1.0, max_requests=4, max_bytes=1 << 30)
    flood = [waiter("flood", klass=2) for _ in range(3)] + [waiter("heavy", klass=1)]
    for w in flood:
        assert q.push(w) == []
    chat = waiter("chat", klass=0)
    assert q.push(chat) == [flood[2]]  # the newest of the lowest class goes
    light = waiter("light", klass=1)
    assert q.push(light) == [flood[1]]
    # Batch gone from the lowest class that has any? No: batch still has one; it goes.
    again = waiter("light", klass=1)
    assert q.push(again) == [flood[0]]
    # Now only class 1 and 0: "heavy" holds 1, "light" 2: light cannot push heavy out.
    assert q.push(waiter("light", klass=1)) is None
    # But a new tenant can push out the biggest one of its class (light, with 2).
    newcomer = waiter("new", klass=1)
    assert q.push(newcomer) == [again]
    assert q.count == 4 and not flood[2].queued


def test_the_same_tenant_cannot_push_itself_out_of_a_full_queue() -> None:
    q = FlowQueue(CLASSES, lambda t: 1.0, max_requests=2, max_bytes=1 << 30)
    assert q.push(waiter("a")) == [] and q.push(waiter("a")) == []
    assert q.push(waiter("a")) is None


def order_of_service(q: FlowQueue) -> list[tuple[str, int, float, float]]:
    """Serves everything: (tenant, class, start, finish) of each, in order."""
    served = []
    while q.count:
        w = serve(q)
        served.append((w.tenant, w.klass, w.start, w.finish))
    return served


def test_an_arrival_that_cannot_fit_pushes_out_nobody_and_changes_nothing() -> None:
    """Pushing out every batch call would not free enough bytes, and the one standard
    call may not go (its tenant holds no more than the arrival's + 1): refused, with
    the queue as it was, tags included (the batch class, that would have gone idle,
    keeps its tenants' finish tags)."""

    def filled() -> tuple[FlowQueue, list[Waiter]]:
        q = FlowQueue(CLASSES, lambda t: 1.0, max_requests=100, max_bytes=100)
        queued = [Waiter(t, 2, 10, size=5, since=0) for t in ("a", "b", "a", "c")]
        queued.append(Waiter("heavy", 1, 10, size=70, since=0))
        for w in queued:
            assert q.push(w) == []
        return q, queued

    q, queued = filled()
    twin, _ = filled()
    assert q.push(Waiter("other", 1, 10, size=60, since=0)) is None
    assert all(w.queued for w in queued) and (q.count, q.bytes) == (5, 90)
    assert q.depth() == twin.depth()
    for same in (q, twin):  # the next arrivals are tagged as if it never came
        same.push(Waiter("a", 2, 10, size=1, since=0))
        same.push(Waiter("heavy", 1, 10, size=1, since=0))
    assert order_of_service(q) == order_of_service(twin)


def test_one_arrival_pushes_out_at_most_max_pushed_calls() -> None:
    def tiny_batch(max_pushed: int) -> tuple[FlowQueue, list[Waiter]]:
        q = FlowQueue(CLASSES, lambda t: 1.0, 1000, max_bytes=100, max_pushed=max_pushed)
        tiny = [Waiter(f"t{i % 3}", 2, 1, size=1, since=0) for i in range(100)]
        for w in tiny:
            q.push(w)
        return q, tiny

    q, tiny = tiny_batch(3)
    assert q.push(Waiter("chat", 0, 1, size=4, since=0)) is None  # 4 would have to go
    assert q.count == 100 and all(w.queued for w in tiny)
    pushed = q.push(Waiter("chat", 0, 1, size=3, since=0))
    # The newest of the biggest tenant each time: t0 holds 34; then each holds 33 and t0
    # the oldest call (ties: the tenant holding the oldest goes first): t0, then t1.
    assert pushed == [tiny[99], tiny[96], tiny[97]]
    q, tiny = tiny_batch(MAX_PUSHED_OUT)
    assert q.push(Waiter("chat", 0, 1, size=MAX_PUSHED_OUT + 1, since=0)) is None
    assert len(q.push(Waiter("chat", 0, 1, size=MAX_PUSHED_OUT, since=0)) or []) == MAX_PUSHED_OUT


def held(q: FlowQueue) -> int:
    """Entries the queue's own tables hold, over every class."""
    return sum(
        len(state.lines)
        + len(state.arrivals)
        + len(state.finish)
        + len(state.spent)
        + len(state.by_tag)
        + len(state.by_age)
        + len(state.by_size)
        for state in q._state
    )


def test_a_drained_queue_holds_nothing_and_a_busy_class_forgets_tenants_gone() -> None:
    q = queue()
    crowd = [waiter(f"t{i}", klass=i % 3) for i in range(2000)]
    for w in crowd:
        q.push(w)
    for w in crowd[::2]:
        q.remove(w)
    order_of_service(q)
    assert held(q) == 0 and q.depth() == {}
    # One tenant keeps the class busy (never idle) while 1,000 others come and go: the
    # finish tags of those gone are dropped once the clock passes them.
    q.push(waiter("steady"))
    for i in range(1000):
        q.push(waiter("steady"))
        q.push(waiter(f"once{i}"))
        serve(q)
        serve(q)
    assert q.count == 1 and held(q) < 20


def test_a_tenant_that_left_and_came_back_keeps_its_finish_tag_while_it_waits() -> None:
    """Cancelled out and back: no credit for what it gave up, and none either once the
    clock has passed the tag it left with (it waits again, with a later one)."""
    q = queue()
    q.push(waiter("s", cost=50))  # keeps the class busy
    gone = waiter("t", cost=100)
    q.push(gone)
    q.remove(gone)  # finish 100, ahead of the clock (0)
    back = waiter("t", cost=100)
    q.push(back)
    assert (back.start, back.finish) == (100, 200)
    for _ in range(4):  # "t" not eligible: the clock passes 100 while it waits
        q.push(waiter("s", cost=50))
        chosen = q.peek(0.0, lambda tenant: tenant == "s")
        assert chosen is not None and chosen.tenant == "s"
        q.pop(chosen)
    again = waiter("t", cost=100)
    q.push(again)
    assert again.start == 200


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
