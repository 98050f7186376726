"""The attacks, one class each, registered by name (`SCENARIOS`; here the usage, ORCA,
trailers and KV-event attacks and the idle calibration, the others in the *_scenarios
modules beside this one). Each starts its own workers and gateway (`prepare`), attacks
(`begin`: background tasks, then returns), and stops (`end`: cancels them and waits,
bounded, for the state the attack leaves). The figures every scenario shares (the
legitimate client, the prober, RSS and threads) are the harness's; a scenario adds its
own (`note`), some with a pass criterion of their own.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.config import OrcaConfig
from gateway.orca.v3 import orca_pb2_grpc
from gateway.orca.v3.orca_pb2 import OrcaLoadReportRequest
from gateway_sim.client import (
    SERVING,
    collect,
    generate_for,
    model_md,
    sgl_generate,
    sgl_grpc,
    stub_for,
    trailers,
    wait_health,
    wait_health_status,
)
from gateway_sim.kv_flood import KvFlooder
from gateway_sim.launch import Child, ready, worker_url
from scripts.attacks.affinity_reload_scenarios import AFFINITY_RELOAD_SCENARIOS
from scripts.attacks.discovery_scenarios import DnsSrv, FileSource, ManyHosts
from scripts.attacks.harness import STATE_WAIT_S, STREAMS_PER_CHANNEL, Scenario, until
from scripts.attacks.outcome import Check
from scripts.attacks.picker_scenarios import PICKER_SCENARIOS
from scripts.attacks.queue_scenarios import FlowQueue, QueueMemory
from scripts.attacks.readings import code_of, tally
from scripts.attacks.worker_scenarios import WORKER_SCENARIOS

LIE = 2**32 - 1  # the usage a lying worker reports (completion_tokens is a uint32)


# --------------------------------------------------------------------------- usage


class Usage(Scenario):
    name = "usage"
    summary = (
        "workers (SGLang and vLLM) reporting completion_tokens 2^32-1 to a tenant with "
        "tokens_per_minute; the legitimate client is another tenant"
    )
    legit_tenant = "legit"
    PER_MINUTE = 1_000_000  # tokens_per_minute of both tenants
    MAX_WAIT_S = 120.0  # a debt is at most about one minute's allowance

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.codes: Counter[str] = Counter()

    async def prepare(self) -> Child:
        lie = ("--usage-completion-tokens", str(LIE))
        sgl_worker, vllm_worker = self.run.workers(
            ("--model", "evil", "--name", "evil-sglang", *lie),
            ("--runtime", "vllm", "--model", "evil-vllm", "--name", "evil-vllm", *lie),
        )
        budget = {"tokens_per_minute": self.PER_MINUTE}
        config = {
            "flow": {"trust_tenant_header": True},
            "tenants": {"attacker": budget, "legit": budget},
        }
        gw = self.run.gateway(
            config,
            worker_url(sgl_worker, model="evil", runtime="sglang"),
            worker_url(vllm_worker, model="evil-vllm", runtime="vllm"),
        )
        await wait_health(gw.address, "evil")
        await wait_health(gw.address, "evil-vllm", "vllm")
        return gw

    async def call(self, runtime: str, n: int) -> tuple[list[Any], aio.AioRpcError | None]:
        model = "evil" if runtime == "sglang" else "evil-vllm"
        stub = stub_for(self.ch, runtime)
        request = generate_for(runtime, f"attack-{n}", tokens=4)
        metadata = model_md(model, ("x-tenant-id", "attacker"))
        return await collect(stub.Generate(request, metadata=metadata, timeout=10))

    async def begin(self) -> None:
        self.ch = self.run.channel()
        self.run.spawn(self.attack())

    async def attack(self) -> None:
        n = 0
        while True:
            _, error = await self.call(("sglang", "vllm")[n % 2], n)
            self.codes[code_of(error)] += 1
            n += 1
            await asyncio.sleep(0.2)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        await self.run.close_channels()
        self.note("attacker's calls while the attack lasted", tally(self.codes))
        self.ch = self.run.channel()
        _, error = await self.call("sglang", -1)
        wait_s, served = 0.0, error is None
        if error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            wait_s = int(trailers(error).get("grpc-retry-pushback-ms", "0")) / 1000
            served = True  # later
        shown = f"{wait_s:.0f} s ({wait_s / 86400:.1f} days; {code_of(error)})"
        passed = served and wait_s <= self.MAX_WAIT_S
        self.note("attacker's wait for its next 7-token call", shown, passed)


# --------------------------------------------------------------------------- discovery


# --------------------------------------------------------------------------- ORCA


ORCA_KEYS = {name: f"{name}-key-0123456789abcdef" for name in ("attacker", "victim", "legit")}


class Orca(Scenario):
    name = "orca"
    summary = (
        "one client opens orca.max_streams StreamCoreMetrics streams, then another client "
        "one (each its own API key: all of them come from 127.0.0.1)"
    )
    legit_key = ORCA_KEYS["legit"]
    MAX_STREAMS = OrcaConfig().max_streams

    async def prepare(self) -> Child:
        self.run.workers()
        keys = self.run.dir / "api-keys"
        keys.write_text("".join(f"{name}:{key}\n" for name, key in ORCA_KEYS.items()))
        return self.run.gateway({"auth": {"api_keys_file": str(keys)}})

    async def ready(self, gw: Child) -> None:
        """Its one model servable: readiness, which needs no key."""
        await wait_health_status(gw.address, "readiness", SERVING)

    def open(self, ch: aio.Channel, who: str = "attacker") -> Any:
        request = OrcaLoadReportRequest(report_interval=Duration(seconds=1))
        metadata = (("authorization", f"Bearer {ORCA_KEYS[who]}"),)
        return orca_pb2_grpc.OpenRcaServiceStub(ch).StreamCoreMetrics(request, metadata=metadata)

    async def begin(self) -> None:
        """As many streams as the gateway takes, up to its orca.max_streams: on one
        connection until one is refused, then on another, until a new connection gets
        none (a cap per connection or per peer makes the client open more of them)."""
        opened = connections = 0
        while opened < self.MAX_STREAMS and connections < self.MAX_STREAMS:
            ch = self.run.channel()
            connections += 1
            on_this = 0
            while opened < self.MAX_STREAMS and on_this < STREAMS_PER_CHANNEL:
                if await self.first_report(self.open(ch)) != "OK":
                    break
                opened += 1
                on_this += 1
            if not on_this:
                break
        self.note(
            "attacker's streams", f"{opened} of {self.MAX_STREAMS} over {connections} connections"
        )
        self.victim = self.run.channel()
        self.victims: Counter[str] = Counter()
        self.run.spawn(self.others())

    async def first_report(self, stream: Any) -> str:
        """OK once a stream's first report came (within 5 s), else why not (the stream
        then cancelled)."""
        try:
            await asyncio.wait_for(stream.read(), 5.0)
            return "OK"
        except aio.AioRpcError as error:
            stream.cancel()
            return code_of(error)
        except TimeoutError:
            stream.cancel()
            return "no report in 5 s"

    async def another(self) -> str:
        """Another client's stream: its first report, or its error; then it ends."""
        stream = self.open(self.victim, "victim")
        try:
            return await self.first_report(stream)
        finally:
            stream.cancel()

    async def others(self) -> None:
        while True:
            self.victims[await self.another()] += 1
            await asyncio.sleep(1.0)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        self.note(
            "another client's streams",
            tally(self.victims),
            sum(self.victims.values()) > 0 and self.victims["OK"] == sum(self.victims.values()),
        )
        await self.run.close_channels()
        self.victim = self.run.channel()

        async def served_again() -> bool:
            return await self.another() == "OK"

        again = await until(served_again, STATE_WAIT_S, every_s=0.25)
        self.note("a stream once the attacker's ended", "served" if again else "NOT served")


# --------------------------------------------------------------------------- trailers

TRAILER_KEY = "x-trailer-bytes"  # gateway_sim/trailers_worker.py: trailers of about N bytes
TRAILER_BYTES = 14 * 1024


def start_trailers_worker() -> Child:
    """The worker that sends the trailers a request asks for (ready)."""
    command = [sys.executable, "-m", "gateway_sim.trailers_worker"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    return ready(process, command)


class Trailers(Scenario):
    name = "trailers"
    summary = "a worker answering with ~14 KB of trailers"

    async def prepare(self) -> Child:
        self.run.workers()  # the legitimate client's
        evil = start_trailers_worker()
        self.run.on_exit(evil.stop)
        self.evil = evil.address
        return self.run.gateway({}, worker_url(evil, model="evil", runtime="sglang"))

    async def begin(self) -> None:
        self.codes: Counter[str] = Counter()
        stub = sgl_grpc.SglangSchedulerStub(self.run.channel())
        for i in range(2):
            self.run.spawn(self.attack(stub, i))

    async def attack(self, stub: Any, index: int) -> None:
        metadata = model_md("evil", (TRAILER_KEY, str(TRAILER_BYTES)))
        n = 0
        while True:
            request = sgl_generate(f"trailers-{index}-{n}")
            _, error = await collect(stub.Generate(request, metadata=metadata, timeout=10))
            self.codes[code_of(error)] += 1
            n += 1
            await asyncio.sleep(0.05)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        self.note("attacker's calls", tally(self.codes))
        worker = (await self.run.listed_workers()).get(self.evil)
        state = "gone"
        if worker is not None:
            status = admin_pb.WorkerStatus.Name(worker.status)
            state = f"{status}, outlier {admin_pb.BreakerState.Name(worker.breaker_state)}"
        self.note("the worker as the gateway sees it", state)


# --------------------------------------------------------------------------- KV events


class KvSnapshot(Scenario):
    name = "kv-snapshot"
    summary = "a worker sending 1M-block KV snapshots while small calls go to another model"
    STALL_BOUND_MS = 100.0
    BLOCKS = 1_000_000

    async def prepare(self) -> Child:
        self.hostile = await asyncio.to_thread(KvFlooder)
        self.run.on_exit(self.hostile.stop)
        self.run.workers()
        evil = f"grpc://127.0.0.1:{self.hostile.port}?model=evil&runtime=sglang"
        gw = self.run.gateway({}, evil)
        await wait_health(gw.address, "evil")
        return gw

    async def begin(self) -> None:
        self.sent = 0
        self.run.spawn(self.flood())

    async def flood(self) -> None:
        """One snapshot after another: each handed to grpc once the gateway read it (or
        started its subscription again)."""
        while True:
            await asyncio.wait_for(self.hostile.flood(f"snapshot {self.BLOCKS}"), 30)
            self.sent += 1

    async def end(self) -> None:
        await self.run.cancel_spawned()
        self.note("snapshots of 1M blocks taken by the gateway", str(self.sent))

    def judge(self, baseline: dict[str, Any], attack: dict[str, Any]) -> list[Check]:
        bound = baseline["p90_ms"] + self.STALL_BOUND_MS
        shown = f"{attack['p99_ms']:.0f} ms (bound {bound:.0f})"
        return [Check("legit p99 <= unloaded p90 + 100 ms", shown, attack["p99_ms"] <= bound)]


class Idle(Scenario):
    name = "idle"
    summary = "no attack: the machine's own noise, to read the others' figures against"

    async def prepare(self) -> Child:
        self.run.workers()
        return self.run.gateway({})

    async def begin(self) -> None:
        pass

    async def end(self) -> None:
        pass


CALIBRATION: dict[str, type[Scenario]] = {Idle.name: Idle}  # not in `all`
SCENARIOS: dict[str, type[Scenario]] = {
    kind.name: kind
    for kind in (
        FlowQueue,
        Usage,
        ManyHosts,
        FileSource,
        Orca,
        Trailers,
        KvSnapshot,
        DnsSrv,
        QueueMemory,
    )
} | {kind.name: kind for kind in (*WORKER_SCENARIOS, *AFFINITY_RELOAD_SCENARIOS, *PICKER_SCENARIOS)}
