"""The queue attacks: a busy worker (its one slot held) and 2,000 calls queued for it,
then a 900 KB call arriving every second that pushes queued calls out (`flow-queue`), or
every queued call ended at once (`queue-memory`)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import grpc

from gateway_sim.client import (
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
)
from gateway_sim.launch import Child, worker_url
from scripts.attacks.harness import STATE_WAIT_S, STREAMS_PER_CHANNEL, Scenario, until
from scripts.attacks.readings import code_of, tally

QUEUED = 2_000  # calls a queue attack holds


# Between one connection's burst of streams and the next: grpc's client cancels some of
# a burst of ~2,000 new streams over fresh connections at once (CANCELLED, never sent).
RAMP_S = 0.1
HOLD = ("x-sim-ttft-ms", "120000")  # a call that holds its worker's one slot until cancelled


def queue_config(**queue: int) -> dict[str, Any]:
    """Model `q` on one worker with one slot, flow control on; the admission bounds
    raised past the attack's calls (the attacker and the legitimate client share
    127.0.0.1, so a per-peer share would refuse the legitimate client by the attacker's
    count, which is not what these scenarios measure)."""
    return {
        "models": {"q": {"max_inflight": 1}},
        "flow": {"trust_tenant_header": True, "queue": {"max_requests": 4096, **queue}},
        "limits": {"max_inflight_requests": 8192, "max_inflight_per_principal": 8192},
    }


class QueueAttack(Scenario):
    """A busy worker (its one slot held) and `QUEUED` calls waiting for it."""

    prompt_tokens = 3  # each queued call's prompt

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.queued_codes: Counter[str] = Counter()

    def queued_request(self, i: int) -> Any:
        request = sgl_generate(f"queued-{i}", tokens=4)
        del request.tokenized.input_ids[:]
        request.tokenized.input_ids.extend(range(10, 10 + self.prompt_tokens))
        return request

    def start_busy(self) -> str:
        (busy,) = self.run.workers(("--model", "q", "--name", "busy", "--headers-first"))
        return worker_url(busy, model="q", runtime="sglang")

    async def fill(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """Hold the worker's slot, then queue `QUEUED` calls (bounded wait for them)."""
        hold = sgl_grpc.SglangSchedulerStub(self.run.channel())
        call = hold.Generate(sgl_generate("hold"), metadata=model_md("q", HOLD), timeout=300)
        self.run.spawn(collect(call))
        await asyncio.wait_for(call.initial_metadata(), STATE_WAIT_S)
        stubs = [
            sgl_grpc.SglangSchedulerStub(self.run.channel())
            for _ in range(math.ceil(QUEUED / STREAMS_PER_CHANNEL))
        ]
        for i in range(QUEUED):
            stub = stubs[i // STREAMS_PER_CHANNEL]
            self.run.spawn(self.queued(stub.Generate(self.queued_request(i), metadata=metadata)))
            if i % STREAMS_PER_CHANNEL == STREAMS_PER_CHANNEL - 1:
                await asyncio.sleep(RAMP_S)
        loop = asyncio.get_running_loop()
        since = loop.time()
        await until(self.all_placed, STATE_WAIT_S, every_s=0.25)
        waiting = await self.run.waiting()
        ended = f"; ended at once: {tally(self.queued_codes)}" if self.queued_codes else ""
        self.note("queued", f"{waiting} of {QUEUED} in {loop.time() - since:.1f} s{ended}")

    async def all_placed(self) -> bool:
        """Every call of the attack waits in the queue or has ended."""
        return await self.run.waiting() + self.queued_codes.total() >= QUEUED

    async def queued(self, call: Any) -> None:
        _, error = await collect(call)
        self.queued_codes[code_of(error)] += 1

    async def empty(self) -> None:
        """Every call of the attack ended (its connections closed), the queue empty."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        await self.run.cancel_spawned()
        await self.run.close_channels()

        async def drained() -> bool:
            return await self.run.waiting() == 0

        emptied = await until(drained, STATE_WAIT_S, every_s=0.25)
        shown = f"empty {loop.time() - since:.1f} s after" if emptied else "NOT empty in 20 s"
        self.note("queue after the attack", shown)


class FlowQueue(QueueAttack):
    name = "flow-queue"
    summary = (
        f"{QUEUED:,} tiny batch calls queued, then a 900 KB standard call arriving every "
        "second (each arrival pushes queued calls out)"
    )
    BIG_TOKENS = 450_000  # ids of 2 varint bytes each: a 900 KB request

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.big_codes: Counter[str] = Counter()
        self.big_took: list[float] = []
        big = sgl_generate("big", tokens=4)
        del big.tokenized.input_ids[:]
        big.tokenized.input_ids.extend(128 + k % 384 for k in range(self.BIG_TOKENS))
        self.big = big

    async def prepare(self) -> Child:
        url = self.start_busy()
        # Room for one big call and half the tiny ones: the first big call pushes half of
        # them out, every later one finds no room even with all of them gone.
        tiny = len(self.queued_request(0).SerializeToString())
        max_bytes = self.big.ByteSize() + QUEUED * tiny // 2
        return self.run.gateway(queue_config(max_bytes=max_bytes), url)

    async def begin(self) -> None:
        await self.fill(model_md("q", ("x-priority", "batch"), ("x-tenant-id", "flood")))
        self.run.spawn(self.arrivals())

    async def arrivals(self) -> None:
        stub = sgl_grpc.SglangSchedulerStub(self.run.channel())
        metadata = model_md("q", ("x-priority", "standard"), ("x-tenant-id", "big"))
        loop = asyncio.get_running_loop()
        while True:
            self.run.spawn(self.big_call(stub, metadata, loop.time()))
            await asyncio.sleep(1.0)

    async def big_call(self, stub: Any, metadata: Any, sent: float) -> None:
        _, error = await collect(stub.Generate(self.big, metadata=metadata, timeout=60))
        self.big_codes[code_of(error)] += 1
        if error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.big_took.append(asyncio.get_running_loop().time() - sent)

    async def end(self) -> None:
        pushed = self.queued_codes["RESOURCE_EXHAUSTED"]
        await self.empty()
        self.note("tiny calls pushed out (QUEUE_FULL) while the attack lasted", f"{pushed}")
        took = max(self.big_took, default=math.nan)
        self.note(
            "900 KB calls",
            f"{tally(self.big_codes)}; slowest refusal {took * 1000:.0f} ms",
        )


class QueueMemory(QueueAttack):
    name = "queue-memory"
    summary = f"{QUEUED:,} queued streams (2 KB prompts), then all of them ended"
    settle_s = 20.0
    prompt_tokens = 1000  # ~2 KB a request

    async def prepare(self) -> Child:
        return self.run.gateway(queue_config(), self.start_busy())

    async def begin(self) -> None:
        await self.fill(model_md("q", ("x-tenant-id", "flood")))

    async def end(self) -> None:
        await self.empty()
