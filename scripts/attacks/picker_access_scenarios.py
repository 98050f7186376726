"""The picker attacks on who may reach the picker's port: wrong API keys from "rotating"
forwarded addresses, or "from" the main port's clients' address
(`picker-forwarded-rotation`), and a plaintext picker port open to every address, which
`gateway serve` refuses at start-up (`picker-plaintext-refused`)."""

from __future__ import annotations

import asyncio
import select
import time
from collections import Counter

from grpc import aio

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
from scripts.attacks.harness import LEGIT_MODEL
from scripts.attacks.picker_client import (
    ANSWER_S,
    SGL_GENERATE,
    WAIT_S,
    PickerScenario,
    answered,
    headers_part,
    open_stream,
)
from scripts.attacks.readings import code_of, metric, tally

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
