"""The idle watch: one look per half period for the whole process moves each stream's
deadline on while its messages move, and lets an idle one end."""

from __future__ import annotations

import asyncio

import pytest

from gateway.observability.record import CallRecord
from gateway.proxy import idle
from gateway.proxy.idle import IdleWatch

IDLE_S = 0.5


MANY = round(3 * IDLE_S / 0.02)  # messages: across three periods at least


async def stream(
    watch: IdleWatch, record: CallRecord, moving: asyncio.Event, many: asyncio.Event
) -> None:
    """Counts a message every 20 ms while `moving` is set, under the watch."""
    async with asyncio.timeout(None) as limit:
        watch.watch(record, limit)
        try:
            while True:
                if moving.is_set():
                    record.messages += 1
                    if record.messages >= MANY:
                        many.set()
                await asyncio.sleep(0.02)
        finally:
            watch.forget(limit)


async def test_a_moving_stream_lives_and_ends_once_idle() -> None:
    watch = IdleWatch(IDLE_S)
    moving, many = asyncio.Event(), asyncio.Event()
    record = CallRecord(rpc="Generate", service="s")
    moving.set()
    task = asyncio.ensure_future(stream(watch, record, moving, many))
    try:
        # Alive across many periods while its messages move (state, not time: counted).
        await asyncio.wait_for(many.wait(), 60)
        assert not task.done()
        moving.clear()
        stopped_at = record.messages
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 60)
        assert record.messages == stopped_at
        assert len(watch) == 0
    finally:
        task.cancel()
        watch.close()


async def test_a_look_at_many_streams_is_cut_into_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idle, "SLICE", 3)
    watch = IdleWatch(3600.0)
    records = [CallRecord(rpc="Generate", service="s") for _ in range(8)]
    limits = []
    for record in records:
        limit = asyncio.timeout(None)
        await limit.__aenter__()
        watch.watch(record, limit)
        limits.append(limit)
        record.messages = 1  # every one moved since it was watched
    before = [limit.when() for limit in limits]
    watch._look()
    moved = sum(limit.when() != b for limit, b in zip(limits, before, strict=True))
    assert moved == 3  # one slice this turn; the rest on the next turns
    for _ in range(3):
        await asyncio.sleep(0)
    assert sum(limit.when() != b for limit, b in zip(limits, before, strict=True)) == 8
    for limit in limits:
        watch.forget(limit)
        limit.reschedule(None)
    watch.close()
