#!/usr/bin/env python3
"""Relay benchmark: the same load direct to a simulated worker and through the gateway.

Not a test. One run starts a zero-delay simulated SGLang worker and a gateway in front of
it (real processes on 127.0.0.1), drives C concurrent server-streaming Generate calls of
N tokens each for D seconds, first direct (the limit), then through the gateway, and
prints streamed messages/s, p50/p99 time to first message, the gateway's CPU seconds per
1,000 relayed messages and the gateway/direct ratio.

Clients: `--client python` (grpc.aio in this process; default) or `--client h2load`
(nghttp2's load generator, one connection, C streams: far cheaper per message, so the
worker and the gateway are what is measured; it reports no per-call time to first
message and ignores grpc-status, so each call's message count is checked by bytes).

    python scripts/bench.py --tokens 16 --concurrency 32 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

from gateway.launch import Child, ready, start, start_sim

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, from /proc (no extra dependency)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def request_bytes(tokens: int) -> bytes:
    return sgl.GenerateRequest(
        request_id="bench",
        tokenized=sgl.TokenizedInput(input_ids=list(range(1, 65))),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens),
        stream=True,
    ).SerializeToString()


@dataclass
class Result:
    label: str
    calls: int
    messages: int
    seconds: float
    ttfm: list[float]
    failures: int
    cpu: dict[str, float]

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def quantile(self, q: float) -> float:
        if not self.ttfm:
            return float("nan")
        ordered = sorted(self.ttfm)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def python_client(
    address: str, args: argparse.Namespace, label: str, pids: dict[str, int], model: str
) -> Result:
    payload = request_bytes(args.tokens)
    expected = args.tokens + 1
    metadata = (("x-model-id", model),)
    calls = messages = failures = 0
    ttfm: list[float] = []
    async with aio.insecure_channel(address) as channel:
        method = channel.unary_stream(GENERATE)
        deadline = time.perf_counter() + 0.5  # warm-up: connect, first calls

        async def stream_loop() -> None:
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

        await asyncio.gather(*(stream_loop() for _ in range(3)))  # warm-up connection
        calls = messages = failures = 0
        ttfm.clear()
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        deadline = time.perf_counter() + args.duration
        began = time.perf_counter()
        await asyncio.gather(*(stream_loop() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - began
        cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return Result(label, calls, messages, seconds, ttfm, failures, cpu)


def grpc_frame(payload: bytes) -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload


def h2load_client(address: str, args: argparse.Namespace, label: str, model: str) -> Result:
    binary = shutil.which("h2load")
    if binary is None:
        raise SystemExit("h2load not found (apt-get install nghttp2-client)")
    with tempfile.NamedTemporaryFile(suffix=".bin") as body:
        body.write(grpc_frame(request_bytes(args.tokens)))
        body.flush()
        command = [
            binary,
            f"http://{address}{GENERATE}",
            "-c1",
            f"-m{args.concurrency}",
            f"-D{max(1, round(args.duration))}",
            "-d",
            body.name,
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "-H",
            f"x-model-id: {model}",
        ]
        began = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, check=False).stdout
        seconds = time.perf_counter() - began
    calls = ok = data = 0
    for line in out.splitlines():
        if line.startswith("requests:"):  # requests: N total, N started, N done, N succeeded, ...
            parts = line.replace(",", "").split()
            calls, ok = int(parts[1]), int(parts[7])
        elif line.startswith("traffic:"):  # traffic: ... total, ... headers (...), X (BYTES) data
            data = int(re.findall(r"\((\d+)\) data", line)[0])
    if calls == 0:
        raise SystemExit(f"h2load made no calls:\n{out}")
    expected = args.tokens + 1
    print(f"{label}: h2load {ok}/{calls} calls ok, {data / max(ok, 1):.1f} response bytes per call")
    return Result(label, ok, ok * expected, min(seconds, args.duration), [], calls - ok, {})


def run_one(
    address: str, args: argparse.Namespace, label: str, pids: dict[str, int], model: str = "bench"
) -> Result:
    if args.client == "python":
        return asyncio.run(python_client(address, args, label, pids, model))
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    result = h2load_client(address, args, label, model)
    result.cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return result


def start_bare_relay(upstream: str) -> Child:
    """The bare grpc.aio relay (scripts/bare_relay.py) in front of `upstream`."""
    command = [sys.executable, str(Path(__file__).with_name("bare_relay.py"))]
    process = subprocess.Popen(
        [*command, "--upstream", upstream], stdout=subprocess.PIPE, text=True
    )
    return ready(process, ["bare_relay", upstream])


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
            f"message: {cpu_per_message(via, 'gateway') / floor:.2f}x"
        )
    if pd is not None:
        print(
            f"PD through the gateway: {pd.rate / direct.rate:.2f}x of direct messages/s; "
            f"p50 time to first message {pd.quantile(0.5):.2f} ms vs {via.quantile(0.5):.2f} ms "
            "regular through the gateway"
        )


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
        "--gateway-arg", action="append", default=[], help="extra `gateway serve` flag"
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
    args = parser.parse_args()

    children: list[Child] = []
    try:
        worker = start_sim("--runtime", "sglang", "--model", "bench")
        children.append(worker)
        workers = ["--worker", f"grpc://{worker.address}?model=bench&runtime=sglang"]
        if args.pd:
            prefill = start_sim("--role", "prefill", "--model", "bench-pd")
            decode = start_sim("--role", "decode", "--model", "bench-pd")
            children += [prefill, decode]
            workers += [
                "--worker",
                f"grpc://{prefill.address}",
                "--worker",
                f"grpc://{decode.address}",
            ]
        gateway = start(
            [
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "off",
                "--log-level",
                "warning",
                *workers,
                *args.gateway_arg,
            ]
        )
        children.append(gateway)
        pids = {"worker": worker.process.pid}
        direct = run_one(worker.address, args, "direct", pids)
        bare = None
        if not args.no_bare:
            relay = start_bare_relay(worker.address)
            children.append(relay)
            bare = run_one(relay.address, args, "bare", {**pids, "bare": relay.process.pid})
            relay.stop()
        pids["gateway"] = gateway.process.pid
        via = run_one(gateway.address, args, "gateway", pids)
        pd = run_one(gateway.address, args, "gateway-pd", pids, "bench-pd") if args.pd else None
        print(
            f"client={args.client} tokens={args.tokens} concurrency={args.concurrency} "
            f"duration={args.duration}s"
        )
        report(direct, via, pd, bare)
    finally:
        for child in reversed(children):
            child.stop()


if __name__ == "__main__":
    main()
