"""The simulated worker's timing model (``--timing``, ``--speed``, ``--max-batch``,
``--max-queue``; sim/gateway_sim/timing.py): the lines fitted to the published figures, the
equations the engine times a call with, the FIFO batch limit and its bounded queue (unit),
and seen from Generate: a slower worker's prefill, a call waiting for a slot and GetLoads'
waiting count (hosted sim workers, tests/sim/conftest.py)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway_sim.active import ActiveRequest
from gateway_sim.behaviour import Behaviour
from gateway_sim.config import SimConfig
from gateway_sim.engine import SimEngine
from gateway_sim.flags import add_sim_arguments
from gateway_sim.timing import PROFILES, QueueFull, Scheduler, fit_line
from tests.sim.kv import engine, prompt
from tests.support.serial import run_alone
from tests.support.sim import StartSim
from tests.support.sim_calls import channel, sgl_request
from tests.support.waits import until

NAME = "h100x2-llama3.3-70b"
PROFILE = PROFILES[NAME]


def config_of(*flags: str) -> SimConfig:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return SimConfig.from_args(parser.parse_args(list(flags)))


# ------------------------------------------------------------------- the fitted lines


def test_the_profile_is_fitted_to_its_published_points() -> None:
    """Prefill: the slope of TTFT between 500 and 5000 input tokens (47.77 and 406.77 ms):
    12,535 tokens/s. ITL: the least-squares line through (1, 18.58), (5, 21.83),
    (25, 38.75), (50, 59.73): 17.69 + 0.841 ms a running call."""
    assert PROFILE.prefill_tokens_per_s == pytest.approx(4500 / 0.359)
    assert PROFILE.itl_base_ms == pytest.approx(17.693, abs=1e-3)
    assert PROFILE.itl_per_seq_ms == pytest.approx(0.8410, abs=1e-4)
    assert PROFILE.prefill_s(5000) == pytest.approx(0.399, abs=1e-3)
    assert PROFILE.itl_s(1) == pytest.approx(0.018534, abs=1e-6)
    assert PROFILE.itl_s(0) == PROFILE.itl_s(1)  # never below one running call
    for batch, itl_ms in PROFILE.itl_points:  # the line stays near every point
        assert PROFILE.itl_s(batch) * 1000 == pytest.approx(itl_ms, rel=0.08)
    assert fit_line([(0, 1.0), (2, 5.0)]) == (1.0, 2.0)


def test_flags_resolve_the_profile_and_its_batch_limit() -> None:
    """Without --timing nothing changes: no batch limit, speed 1. --timing brings the
    profile's batch limit unless --max-batch names one."""
    plain = config_of()
    assert (plain.timing, plain.speed, plain.max_batch, plain.max_queue) == (None, 1.0, None, 1024)
    timed = config_of("--timing", NAME, "--speed", "0.5")
    assert (timed.timing, timed.speed, timed.max_batch) == (NAME, 0.5, PROFILE.max_batch)
    assert config_of("--timing", NAME, "--max-batch", "3").max_batch == 3
    assert config_of("--max-batch", "2").max_batch == 2  # a limit on the fixed knobs too
    for bad in (("--speed", "0"), ("--speed", "nan"), ("--max-batch", "0"), ("--timing", "x")):
        with pytest.raises(SystemExit):
            config_of(*bad)


async def test_speed_divides_every_duration_the_engine_takes() -> None:
    """The equations, read from the engine itself (no clock): prefill = uncached tokens /
    prefill tokens/s, plus --ttft-ms, over the speed; the gap = ITL(running) over the
    speed, read as each chunk starts; the fixed knobs are divided by the speed too."""
    behaviour = Behaviour(ttft_ms=10.0, token_ms=4.0)
    fast = SimEngine("fast", config_of("--timing", NAME))
    slow = SimEngine("slow", config_of("--timing", NAME, "--speed", "0.5"))
    entry = ActiveRequest("r")
    first_fast = fast._first_token_s(entry, behaviour, 5000)
    first_slow = slow._first_token_s(entry, behaviour, 5000)
    assert first_fast == pytest.approx(0.010 + PROFILE.prefill_s(5000))
    assert first_slow == pytest.approx(2 * first_fast)
    # The lane: a second prefill booked at once waits for the first.
    assert fast._first_token_s(entry, behaviour, 5000) == pytest.approx(
        0.010 + 2 * PROFILE.prefill_s(5000), abs=0.005
    )
    gap = slow._gap(entry, behaviour)
    assert gap() == pytest.approx(2 * PROFILE.itl_s(0))
    slow.schedulers[0].running = 40
    assert gap() == pytest.approx(2 * PROFILE.itl_s(40))  # read again: the batch grew
    plain = SimEngine("plain", config_of("--speed", "0.5", "--prefill-us-per-token", "1000"))
    assert plain._first_token_s(entry, behaviour, 100) == pytest.approx(2 * (0.010 + 0.1))
    assert plain._gap(entry, behaviour)() == pytest.approx(0.008)
    unchanged = SimEngine("unchanged", config_of("--prefill-us-per-token", "1000"))
    assert unchanged._first_token_s(entry, behaviour, 100) == 0.010 + 0.001 * 100


# ------------------------------------------------------------------- the batch limit


async def test_scheduler_admits_fifo_within_its_limit() -> None:
    scheduler = Scheduler(limit=1, max_queue=2)
    first, second, third, fourth = (ActiveRequest(f"r{i}") for i in range(4))
    assert not await scheduler.admit(first)
    waits = [asyncio.ensure_future(scheduler.admit(e)) for e in (second, third)]
    await until(lambda: scheduler.waiting == 2, what="two waiting")
    with pytest.raises(QueueFull):
        await scheduler.admit(fourth)  # the queue is bounded
    assert (scheduler.running, scheduler.waiting) == (1, 2)
    scheduler.leave()  # the slot goes to the first in line
    assert await waits[0] is False
    assert not waits[1].done() and (scheduler.running, scheduler.waiting) == (1, 1)
    third.abort()  # aborted in line: out of it, holding nothing
    assert await waits[1] is True
    assert (scheduler.running, scheduler.waiting) == (1, 0)
    scheduler.leave()
    assert scheduler.running == 0


async def test_a_call_cancelled_in_line_leaves_it() -> None:
    scheduler = Scheduler(limit=1, max_queue=4)
    assert not await scheduler.admit(ActiveRequest("holder"))
    waiter = asyncio.ensure_future(scheduler.admit(ActiveRequest("gone")))
    await until(lambda: scheduler.waiting == 1, what="waiting")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (scheduler.running, scheduler.waiting) == (1, 0)
    # Granted and cancelled in the same turn: the slot passes on, not lost.
    late = ActiveRequest("late")
    waiter = asyncio.ensure_future(scheduler.admit(late))
    await until(lambda: scheduler.waiting == 1, what="waiting")
    scheduler.leave()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (scheduler.running, scheduler.waiting) == (0, 0)


# ------------------------------------------------------------------- seen from Generate


async def test_half_speed_doubles_the_prefill(start_sim: StartSim, strict: bool) -> None:
    """A prefill of 4000 uncached tokens: 319 ms at speed 1, 638 ms at 0.5; a sleep is
    never short, so the slow worker is never sooner than that. Against the fast worker
    measured in the same test (calls interleaved, each prompt new to its worker): the
    quickest slow call takes well over the quickest fast one (a busy machine delays some
    calls, rarely all three); the timing tier holds the ratio near 2."""
    flags = ("--timing", NAME, "--max-model-len", "8192", "--vocab-size", "30000")
    fast_sim = start_sim(*flags)
    slow_sim = start_sim(*flags, "--speed", "0.5")
    run_alone()
    fast_s, slow_s = [], []
    async with engine(fast_sim) as fast, engine(slow_sim) as slow:
        for i in range(3):
            tokens = prompt(4000, start=100 + 5000 * i)
            fast_s.append((await fast.generate(tokens, tokens=1)).first_at)
            slow_s.append((await slow.generate(tokens, tokens=1)).first_at)
    assert min(slow_s) >= 2 * PROFILE.prefill_s(4000) * 0.99
    assert min(fast_s) >= PROFILE.prefill_s(4000) * 0.99
    assert min(slow_s) > 1.3 * min(fast_s)
    if strict:
        assert 1.7 < min(slow_s) / min(fast_s) < 2.3


async def test_a_call_past_the_batch_limit_waits_for_a_slot(start_sim: StartSim) -> None:
    """--max-batch 1: a stalled call holds the slot; the next waits (GetLoads: 1 running,
    1 waiting; nothing written to it yet), a third finds the queue (--max-queue 1) full
    and is refused RESOURCE_EXHAUSTED. The stalled call aborted, the waiting one runs to
    its end and the loads come back to nothing."""
    sim = start_sim("--timing", NAME, "--max-batch", "1", "--max-queue", "1")
    async with channel(sim) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)

        async def loads() -> tuple[int, int]:
            reply = await stub.GetLoads(sgl_pb2.GetLoadsRequest(), timeout=5)
            load = reply.loads[0]
            waiting = reply.aggregate.total_waiting_reqs
            assert waiting == load.num_waiting_reqs
            return int(load.num_running_reqs), int(load.num_waiting_reqs)

        holder = stub.Generate(sgl_request("holder"), metadata=(("x-sim-stall", "1"),), timeout=30)
        await until(lambda: _is(loads(), (1, 0)), what="the holder running")
        received: list[Any] = []

        async def read_waiter() -> grpc.StatusCode:
            call = stub.Generate(sgl_request("waiter", max_new_tokens=3), timeout=30)
            async for message in call:
                received.append(message)
            return await call.code()

        waiter = asyncio.ensure_future(read_waiter())
        await until(lambda: _is(loads(), (1, 1)), what="the waiter in line")
        assert received == []
        refused = stub.Generate(sgl_request("refused"), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in refused:
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in (info.value.details() or "")
        assert (await stub.Abort(sgl_pb2.AbortRequest(request_id="holder"))).success
        assert await asyncio.wait_for(waiter, 30) == grpc.StatusCode.OK
        assert received[-1].WhichOneof("response") == "complete"
        assert len(received) == 4  # three tokens and the Complete
        await until(lambda: _is(loads(), (0, 0)), what="nothing left")
        holder.cancel()


async def _is(loads: Awaitable[tuple[int, int]], expected: tuple[int, int]) -> bool:
    return await loads == expected
