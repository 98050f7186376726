"""Memory back after a burst: when to give it back (pure), and nothing of an ended stream
left in a reference cycle by the idle watchdog."""

from __future__ import annotations

import asyncio
import gc

import pytest

from gateway.app.memory import MIN_PEAK, AfterBursts, malloc_trim
from gateway.observability.record import CallRecord
from gateway.proxy.idle import IdleWatch


def test_memory_goes_back_once_a_burst_fell_to_a_quarter_of_its_peak() -> None:
    bursts = AfterBursts()
    assert not any(bursts.see(n) for n in (10, MIN_PEAK - 1, 0))  # never a burst
    assert not any(bursts.see(n) for n in (100, 2000, 1200, 501))
    assert bursts.see(500)  # a quarter of 2,000
    assert bursts.see(100)  # the peak starts again from 500: its tail once more
    assert not bursts.see(0)  # from 100: too little to give back
    assert not any(bursts.see(n) for n in (300, 200))
    assert bursts.see(60)  # a second burst, of 300


def test_malloc_trim_is_found_on_glibc() -> None:
    trim = malloc_trim()
    if trim is None:
        pytest.skip("not glibc")
    trim()


async def test_an_ended_stream_leaves_nothing_in_the_idle_watch() -> None:
    """An ended stream's entry goes as it ends, freed by its reference count (a watchdog
    that held the call's record in a cycle kept 2,000 ended calls' worth of memory until
    a full collection)."""
    watch = IdleWatch(60.0)
    gc.collect()
    gc.disable()
    # Records other tests of this worker process still hold: the baseline of this one.
    before = sum(isinstance(o, CallRecord) for o in gc.get_objects())
    try:

        async def stream() -> None:
            async with asyncio.timeout(None) as limit:
                watch.watch(CallRecord(rpc="Generate", service="s"), limit)
                try:
                    await asyncio.sleep(3600)
                finally:
                    watch.forget(limit)

        task = asyncio.ensure_future(stream())
        await asyncio.sleep(0)
        assert len(watch) == 1
        assert sum(isinstance(o, CallRecord) for o in gc.get_objects()) == before + 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        assert len(watch) == 0
        assert sum(isinstance(o, CallRecord) for o in gc.get_objects()) == before
    finally:
        gc.enable()
        watch.close()
