"""The attacks on what the gateway keeps of its own rather than through a worker: a table
of 20,000 long session keys (`affinity-sessions`) and a SIGHUP storm with a keys file of
17,000 keys (`sighup-storm`)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

from gateway_sim.client import (
    SERVING,
    wait_health,
    wait_health_status,
)
from gateway_sim.launch import Child, worker_url
from scripts.attacks.harness import Scenario
from scripts.attacks.observe import MIB
from scripts.attacks.readings import tally
from scripts.attacks.worker_scenarios import raw_call, request


class AffinitySessions(Scenario):
    name = "affinity-sessions"
    summary = "20,000 calls, each naming a new 256-character session (affinity.header set)"
    SESSIONS, AT_ONCE = 20_000, 50

    async def prepare(self) -> Child:
        (worker,) = self.run.workers(("--model", "aff", "--name", "aff"))
        config = {"affinity": {"header": "x-session-id"}}
        gw = self.run.gateway(config, worker_url(worker, model="aff", runtime="sglang"))
        await wait_health(gw.address, "aff")
        return gw

    async def begin(self) -> None:
        assert self.run.memory is not None
        before, _ = self.run.memory.now()
        ch = self.run.channel()
        codes: Counter[str] = Counter()
        sessions = iter(range(self.SESSIONS))

        async def caller() -> None:
            for n in sessions:
                session = f"{n:0256d}"
                metadata = (("x-session-id", session),)
                codes[(await raw_call(ch, "aff", request(f"s-{n}", 1), metadata))[1]] += 1

        await asyncio.gather(*(caller() for _ in range(self.AT_ONCE)))
        after, _ = self.run.memory.now()
        growth = after - before
        self.note("calls", tally(codes))
        self.note(
            "RSS per session bound",
            f"{growth:+.1f} MiB, {growth * MIB / self.SESSIONS:.0f} B/session",
            growth * MIB / self.SESSIONS <= 400,
        )

    async def end(self) -> None:
        await self.run.close_channels()


KEYS_FILE_KEYS = 17_000  # ~0.95 MB: under the keys file's 1 MiB bound
LEGIT_KEY = "legit:legit-key-0123456789abcdef"


class SighupStorm(Scenario):
    name = "sighup-storm"
    summary = f"100 SIGHUPs, 5 ms apart, with a keys file of {KEYS_FILE_KEYS:,} keys (~1 MiB)"
    legit_key = LEGIT_KEY.partition(":")[2]
    SIGNALS = 100

    async def prepare(self) -> Child:
        self.run.workers()
        keys = self.run.dir / "api-keys"
        lines = [f"k{i}:{i:048d}" for i in range(KEYS_FILE_KEYS)]
        keys.write_text("\n".join([LEGIT_KEY, *lines]) + "\n")
        return self.run.gateway({"auth": {"api_keys_file": str(keys)}})

    async def ready(self, gw: Child) -> None:
        """Its one model servable: readiness, which needs no key."""
        await wait_health_status(gw.address, "readiness", SERVING)

    def reloads(self) -> int:
        text = (self.run.dir / "gateway.log").read_text(errors="replace")
        return text.count("api keys reloaded")

    async def begin(self) -> None:
        assert self.run.gw is not None
        pid = self.run.gw.process.pid
        self.before = self.reloads()
        for _ in range(self.SIGNALS):
            os.kill(pid, signal.SIGHUP)
            await asyncio.sleep(0.005)

    async def end(self) -> None:
        reads = self.reloads() - self.before
        self.note(
            "keys file reads for the storm",
            f"{reads} for {self.SIGNALS} SIGHUPs",
            0 < reads < self.SIGNALS // 2,
        )


AFFINITY_RELOAD_SCENARIOS: tuple[type[Scenario], ...] = (AffinitySessions, SighupStorm)
