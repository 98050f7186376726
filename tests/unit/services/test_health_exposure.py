"""Health exposure and Watch bounds (gateway.services.health): the probe names stay open and
the others need a key, an unknown name is repeated at most 256 characters, watches past the
cap are refused, and a watcher that does not read holds a few statuses. Pure tests with a
fake servicer context."""

from __future__ import annotations

import grpc
from structlog.testing import capture_logs

from gateway.services.health import (
    MAX_SERVICE_NAME,
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVING,
    WATCH_BACKLOG,
)
from tests.support.api_keys import ALICE, Context, check, health, refused


async def test_probe_names_stay_open_and_the_others_need_a_key() -> None:
    service, asked = health(guarded=True)
    for name in ("", "liveness", "readiness"):
        reply = await service.Check(check(name), Context())
        assert reply.status == SERVING
    assert asked == []
    error = await refused(service.Check(check("models/m"), Context()))
    assert error.code is grpc.StatusCode.UNAUTHENTICATED
    error = await refused(service.Check(check("models/nope"), Context()))  # no hint either
    assert error.code is grpc.StatusCode.UNAUTHENTICATED
    assert (await service.Check(check("models/m"), Context(ALICE))).status == SERVING
    error = await refused(anext(service.Watch(check("models/m"), Context())))
    assert error.code is grpc.StatusCode.UNAUTHENTICATED
    assert asked == ["/grpc.health.v1.Health/Check"] * 3 + ["/grpc.health.v1.Health/Watch"]
    watch = service.Watch(check(""), Context())
    assert (await anext(watch)).status == SERVING
    await watch.aclose()


async def test_not_found_repeats_at_most_256_characters() -> None:
    service, _ = health()
    error = await refused(service.Check(check("x" * 10_000), Context()))
    assert error.code is grpc.StatusCode.NOT_FOUND
    assert error.details == f"unknown service {'x' * 256 + '...'!r}"


async def test_a_watch_name_longer_than_any_entry_is_refused() -> None:
    service, _ = health()
    error = await refused(anext(service.Watch(check("x" * (MAX_SERVICE_NAME + 1)), Context())))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    longest = service.Watch(check("models/" + "m" * 256), Context())
    assert (await anext(longest)).status == SERVICE_UNKNOWN
    await longest.aclose()


async def test_watches_over_the_cap_are_refused_and_a_slot_comes_back() -> None:
    service, _ = health(max_watches=2)
    watches = [service.Watch(check(""), Context()) for _ in range(2)]
    for watch in watches:
        assert (await anext(watch)).status == SERVING
    with capture_logs() as logs:
        for _ in range(3):
            error = await refused(anext(service.Watch(check("models/m"), Context())))
            assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details == "too many health watches"
    assert len(logs) == 1  # one line when the cap is hit, not one per refusal
    await watches[0].aclose()
    assert service.watching == 1
    again = service.Watch(check("models/m"), Context())
    assert (await anext(again)).status == SERVING
    for watch in (watches[1], again):
        await watch.aclose()
    assert service.watching == 0 and service._watchers == {}


async def test_a_watcher_that_does_not_read_holds_a_few_statuses() -> None:
    service, _ = health()
    watch = service.Watch(check("models/m"), Context())
    assert (await anext(watch)).status == SERVING
    for i in range(1000):
        service.update({"": SERVING, "models/m": NOT_SERVING if i % 2 == 0 else SERVING})
    (watcher,) = service._watchers["models/m"]
    assert len(watcher.pending) == WATCH_BACKLOG
    service.update({"": SERVING, "models/m": NOT_SERVING})  # the newest is never dropped
    seen = []
    service.close_watches()
    async for reply in watch:
        seen.append(reply.status)
    assert seen[-1] == NOT_SERVING and len(seen) <= WATCH_BACKLOG


async def test_a_watcher_that_reads_sees_every_change_then_the_close() -> None:
    service, _ = health()
    watch = service.Watch(check("models/m"), Context())
    assert (await anext(watch)).status == SERVING
    service.update({"": SERVING, "models/m": NOT_SERVING})
    assert (await anext(watch)).status == NOT_SERVING
    service.update({"": SERVING, "models/m": SERVING})
    service.update({"": SERVING, "models/m": NOT_SERVING})
    service.close_watches()
    assert [r.status async for r in watch] == [SERVING, NOT_SERVING]
