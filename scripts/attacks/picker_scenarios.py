"""The attacks on the endpoint picker's port (`picker.listen`: Envoy's external processing
protocol, `envoy.service.ext_proc.v3.ExternalProcessor/Process`), spoken directly by a
client that is no Envoy: streams that send a call's headers and never its body, wrong
API keys from "rotating" forwarded addresses or "from" another caller's, calls placed and
never reported on, one header map of 200,000 headers; and the gateway started with a
plaintext picker port open to every address. The legitimate client stays on the main
port (the harness's), so each scenario also measures what the picker's attacker costs
the relay's clients."""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import grpc
from grpc import aio

from gateway.picker.service import SERVICE as PICKER_SERVICE
from gateway.picker.v3 import base_pb2, processing_mode_pb2
from gateway.picker.v3 import external_processor_pb2 as ext_proc
from gateway.picker.wire import CODES, framed
from gateway_sim.client import (
    SERVING,
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health_status,
    write_config,
)
from gateway_sim.launch import SERVE_ARGS, Child, spawn, worker_url
from scripts.attacks.harness import LEGIT_MODEL, Check, Scenario, until
from scripts.attacks.worker_scenarios import metric, tally

PROCESS = f"/{PICKER_SERVICE}/Process"
SGL_GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"
DESTINATION = "x-gateway-destination-endpoint"  # picker.header's default
LOOPBACK_PICKER = {"listen": "127.0.0.1:0"}
Mode = processing_mode_pb2.ProcessingMode
WAIT_S = 20.0  # bound on every wait for the state an attack leaves
ANSWER_S = 10.0  # bound on one answer of the picker


# --------------------------------------------------------------------------- ext_proc


def header_map(pairs: Sequence[tuple[str, str]]) -> base_pb2.HeaderMap:
    """Headers as Envoy sends them (values in `raw_value`)."""
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")) for k, v in pairs]
    )


def call_headers(path: str, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    """A gRPC call's request headers as Envoy forwards them to its filter."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", "gateway"),
        (":path", path),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]


def headers_part(
    path: str, *extra: tuple[str, str], body_mode: int | None = None
) -> ext_proc.ProcessingRequest:
    """A stream's first part: the request's headers (a body follows), with the filter's
    body mode if given (none: the modes `gateway envoy-config` sets)."""
    request = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=header_map(call_headers(path, *extra)), end_of_stream=False
        )
    )
    if body_mode is not None:
        request.protocol_config.request_body_mode = body_mode  # type: ignore[assignment]
    return request


def body_part(message: bytes) -> ext_proc.ProcessingRequest:
    """The request's buffered body: one gRPC message, whole."""
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=framed(message), end_of_stream=True)
    )


def serialized(message: Any) -> bytes:
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


def open_stream(ch: aio.Channel) -> Any:
    """One ext_proc stream, written and read part by part (a request serialized already
    is sent as it is)."""
    process = ch.stream_stream(
        PROCESS,
        request_serializer=serialized,
        response_deserializer=ext_proc.ProcessingResponse.FromString,
    )
    return process()


def answered(response: ext_proc.ProcessingResponse) -> str:
    """What an answer of the picker is: its part, or an ImmediateResponse and its code."""
    part = response.WhichOneof("response")
    if part == "immediate_response":
        status = response.immediate_response.grpc_status.status
        code = CODES.get(status)
        return f"ImmediateResponse {code.name if code else status}"
    return part or "empty answer"


def destination_of(response: ext_proc.ProcessingResponse) -> str | None:
    """The worker a body's answer names, if it names one."""
    if response.WhichOneof("response") != "request_body":
        return None
    for option in response.request_body.response.header_mutation.set_headers:
        if option.header.key == DESTINATION:
            return bytes(option.header.raw_value).decode() or option.header.value
    return None


async def to_the_end(stream: Any, answers: list[str]) -> str:
    """Every further answer of a stream (kept in `answers`) until it ends: how it ended,
    the last answer and the stream's status."""
    try:
        while True:
            response = await stream.read()
            if response is aio.EOF:
                break
            answers.append(answered(response))
    except aio.AioRpcError as error:
        return f"stream error {error.code().name}"
    code = await stream.code()
    last = answers[-1] if answers else "no answer"
    return f"{last}, then stream {code.name}"


def code_of(error: aio.AioRpcError | None) -> str:
    return "OK" if error is None else str(error.code().name)


def seconds(values: Sequence[float]) -> str:
    return f"{max(values):.1f} s" if values else "-"


class PickerScenario(Scenario):
    """A scenario whose attacker speaks ext_proc to the picker's port."""

    def picker(self) -> str:
        assert self.run.gw is not None
        return str(self.run.gw.extra["picker"])

    def gateway(self, config: dict[str, Any], *workers: str) -> Child:
        config = {**config, "picker": {**LOOPBACK_PICKER, **config.get("picker", {})}}
        return self.run.gateway(config, *workers)

    async def from_host(self, host: str) -> aio.Channel:
        """A connection to the picker whose peer is `host` (a loopback address other than
        the legitimate client's 127.0.0.1): through a relay of bytes in this process
        whose connections to the gateway are bound to `host`."""
        picker_host, _, picker_port = self.picker().rpartition(":")
        links: list[asyncio.StreamWriter] = []

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            links.append(writer)
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    picker_host, int(picker_port), local_addr=(host, 0)
                )
            except OSError:
                writer.close()
                return
            links.append(up_writer)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        server = await asyncio.start_server(link, "127.0.0.1", 0)

        def close() -> None:
            server.close()
            for writer in links:
                writer.close()

        self.run.on_exit(close)
        port = server.sockets[0].getsockname()[1]
        return self.run.channel(f"127.0.0.1:{port}")


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


# --------------------------------------------------------------------------- 2


KEYS = {name: f"{name}-key-0123456789abcdef" for name in ("legit", "checker")}
THROTTLED = "too many failed attempts"


class PickerForwardedRotation(PickerScenario):
    name = "picker-forwarded-rotation"
    summary = (
        "200 wrong-key picker calls from 127.0.0.2, each claiming another x-forwarded-for; "
        "then 25 from 127.0.0.1 claiming 127.0.0.1, the main port's clients' address "
        "(API keys on)"
    )
    legit_key = KEYS["legit"]
    ROTATING = 200
    POSING = 25
    LIMIT = 20  # auth.failure_limit
    CHECKS = 3  # correct-key main-port calls from 127.0.0.1 afterwards

    async def prepare(self) -> Child:
        self.run.workers()
        keys = self.run.dir / "api-keys"
        keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        auth = {
            "api_keys_file": str(keys),
            "failure_limit": self.LIMIT,
            "failure_window_s": 10,
            "block_s": 30,
        }
        return self.gateway({"auth": auth})

    async def ready(self, gw: Child) -> None:
        """Its one model servable: readiness, which needs no key."""
        await wait_health_status(gw.address, "readiness", SERVING)

    async def failures(self) -> dict[str, float]:
        assert self.run.gw is not None
        reasons = ("missing", "rejected", "throttled")
        found = [
            await metric(self.run.gw, "gateway_auth_failures_total", reason=r) for r in reasons
        ]
        return {r: v or 0.0 for r, v in zip(reasons, found, strict=True)}

    async def wrong_key(self, ch: aio.Channel, n: int, claimed: str) -> str:
        """One wrong-key call claiming `claimed` as the client's address: how the
        picker answered its headers (throttled, rejected, or what else)."""
        request = headers_part(
            SGL_GENERATE,
            ("x-model-id", LEGIT_MODEL),
            ("authorization", f"Bearer wrong-key-{n:06d}-0123456789"),
            ("x-forwarded-for", claimed),
            ("x-envoy-external-address", claimed),
        )
        stream = open_stream(ch)
        try:
            await stream.write(request)
            response = await asyncio.wait_for(stream.read(), ANSWER_S)
        except aio.AioRpcError as error:
            return f"stream error {error.code().name}"
        except TimeoutError:
            return f"no answer in {ANSWER_S:.0f} s"
        finally:
            stream.cancel()
        if response is aio.EOF:
            return "stream ended, no answer"
        kind = answered(response)
        if response.WhichOneof("response") == "immediate_response":
            throttled = THROTTLED in response.immediate_response.body
            return f"{kind} ({'throttled' if throttled else 'rejected'})"
        return kind

    async def begin(self) -> None:
        self.task = self.run.spawn(self.attack())

    async def attack(self) -> None:
        before = await self.failures()
        rotating = await self.from_host("127.0.0.2")
        started = time.monotonic()
        answers = [
            await self.wrong_key(rotating, n, f"198.18.{n // 256}.{n % 256}")
            for n in range(self.ROTATING)
        ]
        took = time.monotonic() - started
        after = await self.failures()
        delta = ", ".join(f"{r} +{after[r] - before[r]:.0f}" for r in after)
        late = answers[self.LIMIT :]
        held = sum("throttled" in a for a in late)
        self.note(
            f"{self.ROTATING} rotating addresses: answers (in {took:.1f} s)",
            tally(Counter(answers)),
        )
        self.note(
            f"blocked as one address (calls past the {self.LIMIT}th throttled)",
            f"{held}/{len(late)}; gateway_auth_failures_total {delta}",
            held == len(late),
        )
        # From the legitimate clients' own address: blocked on the picker's port, never
        # on the main port (the picker's failures are counted apart).
        posing = self.run.channel(self.picker())
        answers = [
            await self.wrong_key(posing, self.ROTATING + n, "127.0.0.1") for n in range(self.POSING)
        ]
        self.note(f"{self.POSING} calls claiming 127.0.0.1: answers", tally(Counter(answers)))
        assert self.run.gw is not None
        stub = sgl_grpc.SglangSchedulerStub(self.run.channel(self.run.gw.address))
        key = ("authorization", f"Bearer {KEYS['checker']}")
        codes: Counter[str] = Counter()
        for n in range(self.CHECKS):
            call = stub.Generate(
                sgl_generate(f"check-{n}"), metadata=model_md(LEGIT_MODEL, key), timeout=10
            )
            _, error = await collect(call)
            codes[code_of(error)] += 1
        self.note(
            "a correct key on the main port from 127.0.0.1 afterwards",
            tally(codes),
            codes["OK"] == self.CHECKS,
        )

    async def end(self) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.task), WAIT_S)
        except TimeoutError:
            self.note("the attack's calls", f"NOT done within {WAIT_S:.0f} s", False)
        await self.run.cancel_spawned()
        await self.run.close_channels()


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


# --------------------------------------------------------------------------- 5


class PickerPlaintextRefused(PickerScenario):
    name = "picker-plaintext-refused"
    summary = (
        "`gateway serve` with picker.listen 0.0.0.0 and no TLS: refused at start-up "
        "(then the run's own gateway, its picker on loopback)"
    )
    START_S = 30.0

    async def prepare(self) -> Child:
        self.run.workers()
        assert self.run.legit is not None
        await asyncio.to_thread(
            self.refused, worker_url(self.run.legit, model=LEGIT_MODEL, runtime="sglang")
        )
        gw = self.gateway({})
        self.note("picker.listen 127.0.0.1 without TLS", "started")
        return gw

    def refused(self, worker: str) -> None:
        """Start a gateway whose picker listens on every address in plaintext: it must
        exit, saying why in a line naming picker.listen."""
        directory = self.run.dir / "plaintext"
        directory.mkdir()
        config = write_config(directory, {"picker": {"listen": "0.0.0.0:0"}})
        log = directory / "stderr"
        cwd = str(self.run.tree) if self.run.tree is not None else None
        with open(log, "w") as errors:
            args = [*SERVE_ARGS, "--config", config, "--worker", worker]
            process = spawn(args, stderr=errors.fileno(), cwd=cwd)
        child = Child(process, 0, tuple(args))  # stopped as every child is
        self.run.on_exit(child.stop)
        started = time.monotonic()
        ready = ""
        assert process.stdout is not None
        while time.monotonic() - started < self.START_S:
            readable, _, _ = select.select([process.stdout], [], [], 0.1)
            if not readable:
                continue
            line = process.stdout.readline()  # the READY line, or EOF as it exits
            if line.startswith("READY "):
                ready = line.strip()
                break
            if not line:
                break
        child.stop()
        took = time.monotonic() - started
        lines = log.read_text(errors="replace").splitlines()
        naming = [line for line in lines if "picker.listen" in line]
        if ready:
            outcome = f"STARTED ({ready}), stopped"
        else:
            outcome = f"exit {process.returncode} after {took:.1f} s"
        said = repr(naming[0][:160]) if naming else "no line names picker.listen"
        self.note("picker.listen 0.0.0.0 without TLS", outcome)
        self.note(
            "refused, one line naming picker.listen",
            f"{said} (stderr: {len(lines)} lines)",
            not ready and process.returncode not in (0, None) and len(naming) >= 1,
        )

    async def begin(self) -> None:
        pass

    async def end(self) -> None:
        pass


PICKER_SCENARIOS: tuple[type[Scenario], ...] = (
    PickerHeaderOnly,
    PickerForwardedRotation,
    PickerHeldCalls,
    PickerHeaderBomb,
    PickerPlaintextRefused,
)
