"""The attacks on the endpoint picker's port (`picker.listen`: Envoy's external processing
protocol, spoken directly by a client that is no Envoy: picker_client.py), registered in
`PICKER_SCENARIOS`: streams that send a call's headers and never its body, calls placed
and never reported on, one header map of 200,000 headers (here); wrong API keys from
"rotating" forwarded addresses or "from" another caller's, and the gateway started with
a plaintext picker port open to every address (picker_access_scenarios.py). The
legitimate client stays on the main port (the harness's), so each scenario also
measures what the picker's attacker costs the relay's clients."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import grpc
from grpc import aio

from gateway_sim.client import (
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
)
from gateway_sim.launch import Child, worker_url
from scripts.attacks.harness import Scenario, until
from scripts.attacks.outcome import Check
from scripts.attacks.picker_access_scenarios import PickerForwardedRotation, PickerPlaintextRefused
from scripts.attacks.picker_client import (
    ANSWER_S,
    SGL_GENERATE,
    VLLM_GENERATE,
    WAIT_S,
    Mode,
    PickerScenario,
    answered,
    body_part,
    destination_of,
    headers_part,
    open_stream,
    seconds,
    serialized,
    to_the_end,
)
from scripts.attacks.readings import code_of, tally

# --------------------------------------------------------------------------- 1


class PickerHeaderOnly(PickerScenario):
    name = "picker-header-only"
    summary = (
        "40 picker streams that send a Generate's request headers and never its body "
        "(limits.request_read_timeout_s 3)"
    )
    STREAMS = 40
    READ_TIMEOUT_S = 3.0
    SLACK_S = 2.0

    async def prepare(self) -> Child:
        sgl, vllm = self.run.workers(
            ("--model", "ho", "--name", "ho"),
            ("--runtime", "vllm", "--model", "ho-v", "--name", "ho-v"),
        )
        return self.gateway(
            {"limits": {"request_read_timeout_s": self.READ_TIMEOUT_S}},
            worker_url(sgl, model="ho", runtime="sglang"),
            worker_url(vllm, model="ho-v", runtime="vllm"),
        )

    async def begin(self) -> None:
        self.ended: dict[int, tuple[float, str]] = {}  # stream -> seconds open, how it ended
        self.answers: dict[int, list[str]] = {}  # stream -> the gateway's answers so far
        self.opened = time.monotonic()
        ch = self.run.channel(self.picker())
        for i in range(self.STREAMS):
            path, model = (SGL_GENERATE, "ho") if i % 4 < 2 else (VLLM_GENERATE, "ho-v")
            mode = None if i % 2 == 0 else Mode.BUFFERED
            request = headers_part(path, ("x-model-id", model), body_mode=mode)
            self.run.spawn(self.headers_only(ch, i, request))

    async def headers_only(self, ch: aio.Channel, i: int, request: Any) -> None:
        stream = open_stream(ch)
        opened = time.monotonic()
        answers = self.answers[i] = []
        await stream.write(request)
        how = await to_the_end(stream, answers)
        self.ended[i] = (time.monotonic() - opened, how)

    async def end(self) -> None:
        bound = self.READ_TIMEOUT_S + self.SLACK_S
        left = self.opened + bound + 1.0 - time.monotonic()

        async def all_ended() -> bool:
            return len(self.ended) == self.STREAMS

        if left > 0:
            await until(all_ended, left)
        await self.run.cancel_spawned()
        await self.run.close_channels()
        took = [s for s, _ in self.ended.values()]
        within = sum(s <= bound for s in took)
        fastest = f"fastest {min(took):.1f} s, " if took else ""
        first = Counter(a[0] if a else "none" for a in self.answers.values())
        self.note("first answer (to the headers)", tally(first))
        self.note("how the streams ended", tally(Counter(how for _, how in self.ended.values())))
        self.note(
            f"streams ended by the gateway within {bound:.0f} s",
            f"{within}/{self.STREAMS} ({fastest}slowest {seconds(took)}; "
            f"{self.STREAMS - len(self.ended)} still open)",
            within == self.STREAMS,
        )

    def judge(self, baseline: dict[str, Any], attack: dict[str, Any]) -> list[Check]:
        calls, ok = attack.get("calls", 0), attack.get("ok", 0)
        return [Check("main-port legit 100% OK", f"{ok}/{calls}", calls > 0 and ok == calls)]


# --------------------------------------------------------------------------- 3


class PickerHeldCalls(PickerScenario):
    name = "picker-held-calls"
    summary = (
        "picker streams placed on every slot of a worker (max_inflight 4), grpc-timeout "
        "3 s, then never a response header or trailer"
    )
    SLOTS = 4
    DEADLINE_S = 3.0
    # The gateway follows a placed call up to its deadline + 1 s (Envoy's answer may
    # trail the worker's end); the rest is a busy machine's timers and this poll.
    SLACK_S = 3.0
    POLL_S = 0.25

    async def prepare(self) -> Child:
        (worker,) = self.run.workers(
            ("--model", "h", "--name", "held", "--max-running", str(self.SLOTS))
        )
        config = {"models": {"h": {"max_inflight": self.SLOTS}}}
        return self.gateway(config, worker_url(worker, model="h", runtime="sglang"))

    async def begin(self) -> None:
        self.held: list[Any] = []
        self.ended: dict[int, str] = {}
        self.main = sgl_grpc.SglangSchedulerStub(self.run.channel())
        ch = self.run.channel(self.picker())
        placed: Counter[str] = Counter()
        self.opened = time.monotonic()
        for i in range(self.SLOTS):
            placed[await self.place(ch, i)] += 1
        self.placed = sum(n for what, n in placed.items() if what.startswith("to "))
        self.note(
            "picker streams placed (the body's answer)",
            tally(placed),
            self.placed == self.SLOTS,
        )
        self.full = await self.main_call("full")  # the slots are taken: refused
        self.note("a main-port call with the slots held", self.full)
        self.polled: Counter[str] = Counter()
        self.freed_s: float | None = None
        self.task = self.run.spawn(self.poll())

    async def place(self, ch: aio.Channel, i: int) -> str:
        """A stream sent to the worker: its headers and body, the answer naming the
        worker read; then it is kept open, and what the gateway does with it noted."""
        stream = open_stream(ch)
        self.held.append(stream)
        timeout = ("grpc-timeout", f"{round(self.DEADLINE_S * 1000)}m")
        headers = headers_part(SGL_GENERATE, ("x-model-id", "h"), timeout)
        try:
            await stream.write(headers)
            first = await asyncio.wait_for(stream.read(), ANSWER_S)
            if first is aio.EOF or first.WhichOneof("response") != "request_headers":
                return f"headers answered {'EOF' if first is aio.EOF else answered(first)}"
            request = sgl_generate(f"held-{i}", tokens=4).SerializeToString()
            await stream.write(body_part(request))
            second = await asyncio.wait_for(stream.read(), ANSWER_S)
        except aio.AioRpcError as error:
            return f"stream error {error.code().name}"
        except TimeoutError:
            return f"no answer in {ANSWER_S:.0f} s"
        if second is aio.EOF:
            return "body answered EOF"
        where = destination_of(second)
        self.run.spawn(self.watch(i, stream))
        return f"to {where}" if where else f"body answered {answered(second)}"

    async def watch(self, i: int, stream: Any) -> None:
        """What the gateway does with a held stream (nothing is ever sent on it)."""
        answers: list[str] = []
        how = await to_the_end(stream, answers)
        self.ended[i] = f"{how} after {time.monotonic() - self.opened:.1f} s"

    async def main_call(self, label: str) -> str:
        call = self.main.Generate(sgl_generate(label), metadata=model_md("h"), timeout=5)
        _, error = await collect(call)
        return code_of(error)

    async def poll(self) -> None:
        """Main-port calls to the model until one is served (bounded)."""
        while time.monotonic() - self.opened < WAIT_S:
            code = await self.main_call("poll")
            self.polled[code] += 1
            if code == "OK":
                self.freed_s = time.monotonic() - self.opened
                return
            await asyncio.sleep(self.POLL_S)

    async def end(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), WAIT_S)
        bound = self.DEADLINE_S + self.SLACK_S
        freed = self.freed_s
        shown = f"NOT within {WAIT_S:.0f} s" if freed is None else f"after {freed:.1f} s"
        held = self.full == "RESOURCE_EXHAUSTED"  # else the slots were never all taken
        self.note(
            f"slots given back: a main-port call served (bound {bound:.0f} s from the "
            "streams' opening)",
            f"{shown}; main-port calls {tally(self.polled)}",
            held and freed is not None and freed <= bound,
        )
        still = self.SLOTS - len(self.ended)
        ended = tally(Counter(self.ended.values())) if self.ended else "none"
        self.note("held streams (never closed by the attacker)", f"{still} open; ended: {ended}")
        await self.run.cancel_spawned()
        await self.run.close_channels()


# --------------------------------------------------------------------------- 4


class PickerHeaderBomb(PickerScenario):
    name = "picker-header-bomb"
    summary = "one ProcessingRequest of 200,000 request headers (~3 MB), 3 times 2 s apart"
    HEADERS = 200_000
    BOMBS = 3
    APART_S = 2.0
    REFUSED_S = 2.0  # "at once": the 3 MB write included, on a busy machine

    async def prepare(self) -> Child:
        (worker,) = self.run.workers(("--model", "hb", "--name", "hb"))
        self.bomb = await asyncio.to_thread(self.build)
        return self.gateway({}, worker_url(worker, model="hb", runtime="sglang"))

    def build(self) -> bytes:
        junk = [(f"x-b{i:06d}", "v") for i in range(self.HEADERS)]
        return serialized(headers_part(SGL_GENERATE, ("x-model-id", "hb"), *junk))

    async def begin(self) -> None:
        self.answers: list[tuple[str, float, bool]] = []  # what, seconds, a refusal
        self.written: list[float] = []  # seconds the write took, where it ended
        self.task = self.run.spawn(self.attack())

    async def attack(self) -> None:
        ch = self.run.channel(self.picker())
        for _ in range(self.BOMBS):
            self.answers.append(await self.one(ch))
            await asyncio.sleep(self.APART_S)

    async def one(self, ch: aio.Channel) -> tuple[str, float, bool]:
        stream = open_stream(ch)
        sent = time.monotonic()
        try:
            await asyncio.wait_for(stream.write(self.bomb), ANSWER_S)
            self.written.append(time.monotonic() - sent)
            response = await asyncio.wait_for(stream.read(), ANSWER_S)
        except aio.AioRpcError as error:
            return f"stream error {error.code().name}", time.monotonic() - sent, True
        except TimeoutError:
            return f"no answer in {ANSWER_S:.0f} s", time.monotonic() - sent, False
        finally:
            stream.cancel()
        took = time.monotonic() - sent
        if response is aio.EOF:
            code = await stream.code()
            return f"stream ended {code.name}", took, code is not grpc.StatusCode.OK
        refused = response.WhichOneof("response") == "immediate_response"
        refused = refused and response.immediate_response.grpc_status.status != 0
        return answered(response), took, refused

    async def end(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), WAIT_S + ANSWER_S * self.BOMBS)
        await self.run.cancel_spawned()
        await self.run.close_channels()
        took = [s for _, s, _ in self.answers]
        refused = sum(r for _, _, r in self.answers)
        self.note(
            f"{self.BOMBS} bombs of {len(self.bomb) / 1e6:.1f} MB: answers",
            tally(Counter(what for what, _, _ in self.answers)),
        )
        self.note(
            f"refused within {self.REFUSED_S:.0f} s",
            f"{refused}/{self.BOMBS} (slowest {seconds(took)}; written in {seconds(self.written)})",
            refused == len(self.answers) == self.BOMBS and max(took) <= self.REFUSED_S,
        )


PICKER_SCENARIOS: tuple[type[Scenario], ...] = (
    PickerHeaderOnly,
    PickerForwardedRotation,
    PickerHeldCalls,
    PickerHeaderBomb,
    PickerPlaintextRefused,
)
