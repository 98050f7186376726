"""The load of scripts/bench/bench.py: C concurrent server-streaming Generate calls for D
seconds over K connections, from grpc.aio in this process or from h2load, with the CPU of
the processes watched meanwhile (`Result`); phases run in alternation; CPU per message."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from grpc import aio
from proc_cpu import cpu_seconds, snapshot
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"


LOCAL_POOL = ("grpc.use_local_subchannel_pool", 1)  # one connection per channel


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


def cpu_per_message(result: Result, name: str) -> float:
    """Seconds of `name`'s CPU per relayed message."""
    return result.cpu.get(name, 0.0) / result.messages if result.messages else float("nan")
