"""The attacks, one class each (`SCENARIOS`, by name). Each starts its own workers and
gateway (`prepare`), attacks (`begin`: background tasks, then returns), and stops
(`end`: cancels them and waits, bounded, for the state the attack leaves). The figures
every scenario shares (the legitimate client, the prober, RSS and threads) are the
harness's; a scenario adds its own (`note`), some with a pass criterion of their own.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
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
    closed_port,
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
from gateway_sim.dnsmasq import Dnsmasq
from gateway_sim.kv_flood import KvFlooder
from gateway_sim.launch import Child, ready, worker_url
from scripts.attacks.harness import Check, Scenario, until
from scripts.attacks.picker_scenarios import PICKER_SCENARIOS
from scripts.attacks.worker_scenarios import WORKER_SCENARIOS

LIE = 2**32 - 1  # the usage a lying worker reports (completion_tokens is a uint32)
QUEUED = 2_000  # calls a queue attack holds
STREAMS_PER_CHANNEL = 125  # under grpc's 256 concurrent streams per connection
# Between one connection's burst of streams and the next: grpc's client cancels some of
# a burst of ~2,000 new streams over fresh connections at once (CANCELLED, never sent).
RAMP_S = 0.1
HOLD = ("x-sim-ttft-ms", "120000")  # a call that holds its worker's one slot until cancelled
STATE_WAIT_S = 20.0  # bound on every wait for the state an attack leaves


def code_of(error: aio.AioRpcError | None) -> str:
    return "OK" if error is None else str(error.code().name)


def counts(codes: Counter[str]) -> str:
    return ", ".join(f"{code} {n}" for code, n in codes.most_common()) or "none"


def closed_ports(scenario: Scenario, count: int) -> list[int]:
    """Ports nobody listens on (bound, never listening, held until the run ends)."""
    sockets = [closed_port() for _ in range(count)]
    for sock in sockets:
        scenario.run.on_exit(sock.close)
    return [int(sock.getsockname()[1]) for sock in sockets]


def closed_url(port: int, model: str) -> str:
    return f"grpc://127.0.0.1:{port}?model={model}&runtime=sglang"


def write_atomically(path: Path, text: str) -> None:
    """Write and rename, as an editor or a ConfigMap update does."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


# --------------------------------------------------------------------------- queues


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
        ended = f"; ended at once: {counts(self.queued_codes)}" if self.queued_codes else ""
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
            f"{counts(self.big_codes)}; slowest refusal {took * 1000:.0f} ms",
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
        self.note("attacker's calls while the attack lasted", counts(self.codes))
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


class FileHosts(Scenario):
    """A file discovery source whose file the attack rewrites (model `fm`)."""

    def file_config(self, first: str) -> dict[str, Any]:
        self.path = self.run.dir / "workers.yaml"
        write_atomically(self.path, f"- {first}\n")
        source = {"source": "file", "path": str(self.path), "interval_s": 1}
        return {"discovery": [source], "discovery_timeout_s": 2}

    async def listed(self) -> set[str]:
        """The workers the file source put in (ids)."""
        workers = await self.run.listed_workers()
        return {w.id for w in workers.values() if w.model == "fm"}


class ManyHosts(FileHosts):
    name = "many-hosts"
    summary = "a file source listing 2,000 hosts on closed ports, then one host again"
    HOSTS = 2_000

    async def prepare(self) -> Child:
        self.run.workers()
        self.first = closed_ports(self, 1)[0]
        return self.run.gateway(self.file_config(closed_url(self.first, "fm")))

    async def begin(self) -> None:
        # Taken once every process is up: select() in the launcher takes no fd past 1023.
        ports = closed_ports(self, self.HOSTS)
        urls = "".join(f"- {closed_url(p, 'fm')}\n" for p in ports)
        write_atomically(self.path, urls)
        self.most = self.unanswered = 0
        self.joined_s = math.nan
        self.run.spawn(self.watch(asyncio.get_running_loop().time()))

    async def watch(self, since: float) -> None:
        while True:
            try:
                listed = len(await self.listed())
            except aio.AioRpcError:  # the admin port of a stalled gateway: ask again
                self.unanswered += 1
                continue
            self.most = max(self.most, listed)
            if listed >= self.HOSTS and math.isnan(self.joined_s):
                self.joined_s = asyncio.get_running_loop().time() - since
            await asyncio.sleep(1.0)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        joined = f"all {self.HOSTS} after {self.joined_s:.1f} s"
        if math.isnan(self.joined_s):
            joined = f"never all {self.HOSTS}"
        if self.unanswered:
            joined += f"; ListWorkers got no answer within 10 s, {self.unanswered} times"
        self.note("hosts listed at most", f"{self.most} ({joined})")
        write_atomically(self.path, f"- {closed_url(self.first, 'fm')}\n")
        loop = asyncio.get_running_loop()
        since = loop.time()

        async def one_left() -> bool:
            return len(await self.listed()) == 1

        left = await until(one_left, STATE_WAIT_S * 1.5, every_s=0.5)
        shown = f"{loop.time() - since:.1f} s" if left else "NOT within 30 s"
        self.note("back to one host", shown)


class FileSource(FileHosts):
    name = "file-source"
    summary = "a ~1 MiB workers file (one host, the rest comments) rewritten every second"
    FILE_BYTES = 1_000_000  # under the file source's 1 MiB bound

    async def prepare(self) -> Child:
        self.run.workers()
        self.ports = closed_ports(self, 2)
        return self.run.gateway(self.file_config(closed_url(self.ports[0], "fm")))

    def big_file(self, nonce: int) -> str:
        head = f"- {closed_url(self.ports[0], 'fm')}\n"
        line = f"# padding {nonce:08d} " + "x" * 60 + "\n"
        return head + line * ((self.FILE_BYTES - len(head)) // len(line))

    async def begin(self) -> None:
        self.writes = 0
        self.run.spawn(self.rewrite())

    async def rewrite(self) -> None:
        while True:
            await asyncio.to_thread(write_atomically, self.path, self.big_file(self.writes))
            self.writes += 1
            await asyncio.sleep(1.0)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        self.note("rewrites", f"{self.writes} of {len(self.big_file(0)):,} bytes")
        other = f"127.0.0.1:{self.ports[1]}"
        write_atomically(self.path, f"- {closed_url(self.ports[1], 'fm')}\n")

        async def read_again() -> bool:
            return other in await self.listed()

        read = await until(read_again, STATE_WAIT_S, every_s=0.25)
        self.note("the last (small) file read", "yes" if read else "NOT within 20 s")


DNS_NAME = "attack.test"


class DnsSrv(Scenario):
    name = "dns-srv"
    summary = "20 SRV targets, 5 of which do not resolve (dnsmasq)"
    TARGETS = 20
    RESOLVING = 15

    def unavailable(self) -> str | None:
        if shutil.which("dnsmasq") or Path("/usr/sbin/dnsmasq").exists():
            return None
        return "dnsmasq is not installed (apt-get install -y dnsmasq-base)"

    async def prepare(self) -> Child:
        self.ports = closed_ports(self, self.TARGETS)
        srv = [
            f"--srv-host=_grpc._tcp.{DNS_NAME},t{i}.{DNS_NAME},{port}"
            for i, port in enumerate(self.ports)
        ]
        self.dns = Dnsmasq(self.run.dir, *srv)
        self.dns.start()
        self.run.on_exit(self.dns.stop)
        self.run.workers()
        source = {
            "source": "dns",
            "name": f"_grpc._tcp.{DNS_NAME}",
            "nameserver": self.dns.address,
            "interval_s": 1,
            "model": "d",
            "runtime": "sglang",
        }
        return self.run.gateway({"discovery": [source], "discovery_timeout_s": 1})

    async def begin(self) -> None:
        """No target resolved until now; now all but 5 do."""
        records = {f"t{i}.{DNS_NAME}": ["127.0.0.1"] for i in range(self.RESOLVING)}
        await asyncio.to_thread(self.dns.set, records)
        self.most = 0
        self.run.spawn(self.watch())

    async def watch(self) -> None:
        while True:
            try:
                workers = await self.run.listed_workers()
            except aio.AioRpcError:  # the admin port of a stalled gateway: ask again
                continue
            self.most = max(self.most, sum(1 for w in workers.values() if w.model == "d"))
            await asyncio.sleep(0.5)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        shown = f"{self.most} of {self.RESOLVING} resolvable ({self.TARGETS} SRV targets)"
        self.note("hosts joined", shown, self.most == self.RESOLVING)


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
            counts(self.victims),
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
        self.note("attacker's calls", counts(self.codes))
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
} | {kind.name: kind for kind in (*WORKER_SCENARIOS, *PICKER_SCENARIOS)}
