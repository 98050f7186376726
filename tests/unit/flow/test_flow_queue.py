"""The waiting room's order of service, rule by rule (pure: no clock, no awaiting): priority
between classes, fair shares of tokens between tenants, starvation, the bounds and who a
full queue pushes out, what a drained queue still holds."""

from __future__ import annotations

from collections import Counter

from gateway.flow.queue import MAX_PUSHED_OUT, FlowQueue, Waiter
from tests.support.queues import CLASSES, held


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
