"""The observers, each a process of its own so that no attack traffic shares their event
loop: the legitimate client (`_legit`: small Generate calls to its own model, closed loop)
and the health prober (`_health`: `grpc.health.v1.Health/Check` of service "" every
20 ms, whose late answers are the gateway's event loop stalling).

Driven over stdin, one command a line: `connect ADDRESS` (the gateway: the process can
start, and import, while the gateway does); `run LABEL SECONDS` measures for that long and
answers one JSON line on stdout; `quit`, or the end of stdin, ends the process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_sim.client import channel, collect, model_md, sgl_generate, sgl_grpc

PROBE_EVERY_S = 0.020
PROBE_TIMEOUT_S = 2.0
CALL_TIMEOUT_S = 5.0
CALL_PAUSE_S = 0.010  # between one legit call and the next, per loop: a modest load
LEGIT_LOOPS = 2
LEGIT_TOKENS = 4

Measure = Callable[[aio.Channel, str, float], Awaitable[dict[str, Any]]]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stalls(started: float, replies: Sequence[float], every_s: float) -> list[float]:
    """How much later than `every_s` each answer came after the one before (the first
    after `started`): 0 for a prober answered on time."""
    gaps, previous = [], started
    for reply in replies:
        gaps.append(max(0.0, reply - previous - every_s))
        previous = reply
    return gaps


def call_stats(label: str, calls: Sequence[tuple[float, str]]) -> dict[str, Any]:
    """The legit client's figures: calls, OK, codes, latency p50/p90/p99 (ms) of all."""
    latencies = [took * 1000 for took, _ in calls]
    codes = Counter(code for _, code in calls)
    return {
        "label": label,
        "calls": len(calls),
        "ok": codes.get("OK", 0),
        "codes": dict(codes),
        "p50_ms": percentile(latencies, 0.50),
        "p90_ms": percentile(latencies, 0.90),
        "p99_ms": percentile(latencies, 0.99),
    }


def stall_stats(
    label: str, started: float, replies: Sequence[float], failed: int, every_s: float
) -> dict[str, Any]:
    gaps = [g * 1000 for g in stalls(started, replies, every_s)]
    return {
        "label": label,
        "checks": len(replies),
        "failed": failed,
        "max_ms": max(gaps, default=math.nan),
        "p99_ms": percentile(gaps, 0.99),
    }


async def legit_calls(
    stub: Any, metadata: Sequence[tuple[str, str | bytes]], seconds: float, prefix: str
) -> list[tuple[float, str]]:
    """`LEGIT_LOOPS` loops of one small streamed Generate after another, for `seconds`:
    each call's (latency, status name); OK only if its stream ended with its Complete."""
    end = time.monotonic() + seconds
    calls: list[tuple[float, str]] = []

    async def loop(index: int) -> None:
        n = 0
        while time.monotonic() < end:
            request = sgl_generate(f"{prefix}-{index}-{n}", tokens=LEGIT_TOKENS)
            n += 1
            started = time.perf_counter()
            messages, error = await collect(
                stub.Generate(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
            )
            took = time.perf_counter() - started
            complete = bool(messages) and messages[-1].WhichOneof("response") == "complete"
            code = error.code().name if error is not None else ("OK" if complete else "SHORT")
            calls.append((took, code))
            await asyncio.sleep(CALL_PAUSE_S)

    await asyncio.gather(*(loop(i) for i in range(LEGIT_LOOPS)))
    return calls


async def health_checks(stub: Any, seconds: float) -> tuple[float, list[float], int]:
    """Check "" every `PROBE_EVERY_S` (after the answer before), for `seconds`: the start,
    each answer's arrival and how many failed (a failure's arrival counts too)."""
    request = health_pb2.HealthCheckRequest(service="")
    started = time.monotonic()
    end = started + seconds
    replies: list[float] = []
    failed = 0
    while time.monotonic() < end:
        sent = time.monotonic()
        try:
            reply = await stub.Check(request, timeout=PROBE_TIMEOUT_S)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                failed += 1
        except aio.AioRpcError:
            failed += 1
        now = time.monotonic()
        replies.append(now)
        await asyncio.sleep(max(0.0, PROBE_EVERY_S - (now - sent)))
    return started, replies, failed


async def serve(measure: Measure) -> None:
    """Answer `connect ADDRESS` and `run LABEL SECONDS` lines from stdin until `quit` or
    its end."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    ch: aio.Channel | None = None
    try:
        while line := (await reader.readline()).decode().strip():
            verb, *words = line.split()
            if verb == "quit":
                return
            if verb == "connect" and len(words) == 1:
                ch = channel(words[0])
            elif verb == "run" and len(words) == 2 and ch is not None:
                result = await measure(ch, words[0], float(words[1]))
                print(json.dumps(result), flush=True)
    finally:
        if ch is not None:
            await ch.close()


def legit_metadata(
    model: str, tenant: str | None, key: str | None
) -> tuple[tuple[str, str | bytes], ...]:
    """The legitimate client's metadata: its model, and its tenant and API key if any."""
    extra = [("x-tenant-id", tenant)] if tenant else []
    extra += [("authorization", f"Bearer {key}")] if key else []
    return model_md(model, *extra)


async def legit_main(metadata: Sequence[tuple[str, str | bytes]]) -> None:
    async def measure(ch: aio.Channel, label: str, seconds: float) -> dict[str, Any]:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        return call_stats(label, await legit_calls(stub, metadata, seconds, label))

    await serve(measure)


async def health_main() -> None:
    async def measure(ch: aio.Channel, label: str, seconds: float) -> dict[str, Any]:
        started, replies, failed = await health_checks(health_pb2_grpc.HealthStub(ch), seconds)
        return stall_stats(label, started, replies, failed, PROBE_EVERY_S)

    await serve(measure)


def main(role: str, argv: Sequence[str]) -> None:
    """`_legit [--model M] [--tenant T] [--key K]` or `_health`."""
    parser = argparse.ArgumentParser(prog=f"attack.py {role}")
    parser.add_argument("--model", default="legit")
    parser.add_argument("--tenant", default=None)
    parser.add_argument("--key", default=None, help="API key (authorization: Bearer)")
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group: the harness ends this process (stdin).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if role == "_legit":
        asyncio.run(legit_main(legit_metadata(args.model, args.tenant, args.key)))
    else:
        asyncio.run(health_main())
