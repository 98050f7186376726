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

    async def idle_stream(record: CallRecord) -> None:
        async with asyncio.timeout(None) as limit:
            watch.watch(record, limit)
            try:
                await asyncio.sleep(3600)
            finally:
                watch.forget(limit)

    streams = [asyncio.ensure_future(idle_stream(record)) for record in records]
    try:
        await asyncio.sleep(0)
        assert len(watch) == 8
        for seen in watch._streams.values():
            seen.moved_at -= 3600.0
        limits = list(watch._streams)  # each stream's deadline
        watch._look()  # the look, now rather than in half an hour
        assert sum(limit.when() is not None for limit in limits) == 3  # one slice this turn
        await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 60)
        assert all(isinstance(s.exception(), TimeoutError) for s in streams)
        assert len(watch) == 0
    finally:
        for stream in streams:
            stream.cancel()
        watch.close()
