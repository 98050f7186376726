"""Flow-control benchmark: the same overload with flow control off and on.

Not a test. Two simulated SGLang workers, each taking `--slots` calls at a time (the
model's `max_inflight`), each call lasting about `--ttft-ms` + `--tokens` x `--token-ms`.
For `--duration` seconds, open-loop clients offer (per second, as fractions of the fleet's
capacity in calls/s):

- batch  3x capacity, class batch       (a tenant flooding the gateway)
- chat   0.1x,        class interactive (a modest steady rate)
- std-a  6x,          class standard    (two standard tenants offering 10:1, both
- std-b  0.6x,        class standard     more than their half of what chat leaves)

and prints, per tenant: calls offered, served (OK), refused by reason, time to first
message p50/p99 of the served ones, tokens served; then Jain's fairness index over the
two standard tenants' served tokens (1.0: equal). Off: every call past capacity is
WORKERS_OVERLOADED at once. On: calls wait by class, fairly between tenants.

Two more scenarios, flow control on (`--scenario`, default all three):

- weights:    two standard tenants of weights 2 and 1 (`tenants:` weight), each offering
              2x capacity: the tokens served while both are backlogged split 2:1 (within
              10% is the target);
- starvation: an interactive tenant offering 1.25x capacity (it alone saturates the
              fleet) and one batch call at `--batch-at` s, batch `starvation_s`
              `--starvation-s`: the batch call's queue wait against starvation_s plus
              one service time (the target).

Every run also prints, per simulated worker, the most calls it ever ran at once (its
`x-sim-running` response header: the worker's own count) against its max_inflight.

    python scripts/bench/bench_flow.py --duration 20
    python scripts/bench/bench_flow.py --duration 10 --scenario weights
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway_sim.launch import Child, start, start_sim, stop_all

STATUS_REASON = "x-gateway-reason"


@dataclass
class Tenant:
    name: str
    klass: str
    share: float  # offered calls/s as a fraction of the fleet's capacity
    offered: int = 0
    served: int = 0
    tokens: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    first: list[float] = field(default_factory=list)
    at: tuple[float, ...] = ()  # fixed arrival times (s after the start) instead of a rate
    window_tokens: int = 0  # tokens of the calls that ended before the offered load did


@dataclass
class Offer:
    """One run's shared state: when the offered load ends, and the most calls each
    worker reported running (x-sim-running) as it answered."""

    ends: float = float("inf")
    running: dict[str, int] = field(default_factory=dict)


def tenants(std_b_share: float) -> list[Tenant]:
    return [
        Tenant("batch", "batch", 3.0),
        Tenant("chat", "interactive", 0.1),
        Tenant("std-a", "standard", std_b_share * 10),
        Tenant("std-b", "standard", std_b_share),
    ]


REASONS = {  # how each refusal's message starts or what it says
    "queue is full": "QUEUE_FULL",
    "Waited ": "QUEUE_TIMEOUT",
    "are overloaded": "WORKERS_OVERLOADED",
    "shutting down": "SHUTTING_DOWN",
}


def reason_of(error: aio.AioRpcError) -> str:
    details = error.details() or ""
    return next((r for text, r in REASONS.items() if text in details), error.code().name)


async def one_call(
    stub: sgl_grpc.SglangSchedulerStub, tenant: Tenant, tokens: int, i: int, run: Offer
) -> None:
    request = sgl.GenerateRequest(
        request_id=f"{tenant.name}-{i}",
        tokenized=sgl.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens),
        stream=True,
    )
    metadata = (("x-model-id", "m"), ("x-priority", tenant.klass), ("x-tenant-id", tenant.name))
    tenant.offered += 1
    started = time.monotonic()
    first = None
    chunks = 0
    call = stub.Generate(request, metadata=metadata, timeout=120)
    try:
        async for message in call:
            if first is None:
                first = time.monotonic() - started
                seen(run, dict(await call.initial_metadata()))
            if message.WhichOneof("response") == "chunk":
                chunks += 1
    except aio.AioRpcError as error:
        tenant.refused[reason_of(error)] += 1
        return
    tenant.served += 1
    tenant.tokens += chunks
    if time.monotonic() <= run.ends:
        tenant.window_tokens += chunks
    if first is not None:
        tenant.first.append(first)


def seen(run: Offer, headers: dict[str, Any]) -> None:
    """A worker's own count of the calls it ran as it answered one (x-sim-running)."""
    worker, running = headers.get("x-sim-worker"), headers.get("x-sim-running")
    if worker is not None and running is not None:
        run.running[str(worker)] = max(run.running.get(str(worker), 0), int(running))


async def offer(
    address: str, load: list[Tenant], capacity: float, duration: float, tokens: int, run: Offer
) -> None:
    rng = random.Random(7)
    async with aio.insecure_channel(address) as channel:
        stub = sgl_grpc.SglangSchedulerStub(channel)
        calls: set[asyncio.Task[None]] = set()
        run.ends = time.monotonic() + duration

        def launch(tenant: Tenant, i: int) -> None:
            task = asyncio.ensure_future(one_call(stub, tenant, tokens, i, run))
            calls.add(task)
            task.add_done_callback(calls.discard)

        async def arrivals(tenant: Tenant) -> None:
            if tenant.at:  # at fixed times, whatever the duration
                begun = time.monotonic()
                for i, at in enumerate(tenant.at):
                    await asyncio.sleep(max(0.0, begun + at - time.monotonic()))
                    launch(tenant, i)
                return
            rate = tenant.share * capacity
            end = time.monotonic() + duration
            i = 0
            while time.monotonic() < end:
                launch(tenant, i)
                i += 1
                await asyncio.sleep(rng.expovariate(rate))

        await asyncio.gather(*(arrivals(t) for t in load))
        if calls:
            await asyncio.wait(calls, timeout=130)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


def report(label: str, load: list[Tenant], fairness: bool = True) -> None:
    print(f"\n== flow control {label}")
    print(f"{'tenant':8} {'class':12} {'offered':>8} {'served':>7} {'tokens':>7} "
          f"{'ttft p50':>9} {'ttft p99':>9}  refused")  # fmt: skip
    for t in load:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(t.refused.items())) or "-"
        p50, p99 = percentile(t.first, 0.5), percentile(t.first, 0.99)
        print(f"{t.name:8} {t.klass:12} {t.offered:8} {t.served:7} {t.tokens:7} "
              f"{p50 * 1000:8.0f}ms {p99 * 1000:8.0f}ms  {refused}")  # fmt: skip
    if fairness:  # between equal weights
        standard = [float(t.tokens) for t in load if t.klass == "standard"]
        print(f"Jain's index, standard tenants' served tokens: {jain(standard):.3f}")


def report_running(run: Offer, slots: int) -> None:
    """The most calls each worker ran at once, by its own count, against max_inflight."""
    by_worker = ", ".join(f"{w} {n}" for w, n in sorted(run.running.items())) or "-"
    verdict = "within" if all(n <= slots for n in run.running.values()) else "OVER"
    print(f"most calls running per worker (x-sim-running): {by_worker}; "
          f"max_inflight {slots}: {verdict}")  # fmt: skip


def flow_settings(args: argparse.Namespace) -> dict[str, object]:
    """The mix's flow section: short waits, a small queue (the run ends soon after the
    load does)."""
    return {
        "trust_tenant_header": True,
        "queue": {"max_requests": args.queue},
        "classes": [
            {"name": "interactive", "ttl_s": 10.0},
            {"name": "standard", "ttl_s": 10.0},
            {"name": "batch", "ttl_s": 20.0, "starvation_s": 5.0},
        ],
    }


def run(
    args: argparse.Namespace,
    flow: dict[str, object] | None,
    load: list[Tenant],
    tenant_settings: dict[str, object] | None = None,
    log: Path | None = None,
) -> Offer:
    """Start two workers and a gateway (`flow` its flow section, None: off), offer `load`
    for `--duration` s, stop them all. `log`: where the gateway's JSON log goes."""
    directory = Path(tempfile.mkdtemp(prefix="bench-flow-"))
    timing = ("--ttft-ms", str(args.ttft_ms), "--token-ms", str(args.token_ms))
    workers = [start_sim("--model", "m", "--name", f"w{i}", *timing) for i in range(2)]
    config: dict[str, object] = {
        "workers": [f"grpc://{w.address}?model=m&runtime=sglang" for w in workers],
        "models": {"m": {"max_inflight": args.slots}},
    }
    if flow is not None:
        config["flow"] = flow
    if tenant_settings:
        config["tenants"] = tenant_settings
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    listen = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
    serve = ["serve", "--config", str(path), *listen, "--metrics-listen", "off"]
    if log is None:
        gateway: Child = start(serve)
    else:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            gateway = start([*serve, "--log-format", "json"], stderr=fd)
        finally:
            os.close(fd)
    service_s = (args.ttft_ms + args.tokens * args.token_ms) / 1000
    capacity = 2 * args.slots / service_s
    state = Offer()
    try:
        asyncio.run(offer(gateway.address, load, capacity, args.duration, args.tokens, state))
    finally:
        stop_all([gateway.process, *(w.process for w in workers)])
    print(f"\ncapacity {capacity:.1f} calls/s (2 workers x {args.slots} slots, "
          f"service {service_s * 1000:.0f} ms)")  # fmt: skip
    return state


def mix(args: argparse.Namespace) -> None:
    """The batch flood, a modest interactive tenant and two standard tenants at 10:1,
    flow control off, then on."""
    for label, flow in (("off", None), ("on", flow_settings(args))):
        load = tenants(args.std_b)
        log = Path(tempfile.mkdtemp(prefix="bench-flow-log-")) / "gateway.log"
        state = run(args, flow, load, log=log if flow is not None else None)
        report(label, load)
        if flow is not None:
            report_waits(log)
        a, b = (t.window_tokens for t in load if t.klass == "standard")
        print(f"standard tokens served while the load lasted: std-a {a}, std-b {b}; "
              f"shares {a / max(a + b, 1):.3f} : {b / max(a + b, 1):.3f}, "
              f"Jain {jain([float(a), float(b)]):.3f}")  # fmt: skip
        report_running(state, args.slots)


def weights(args: argparse.Namespace) -> None:
    """Two backlogged standard tenants, weights 2:1, equal heavy offered load: the tokens
    served while the load lasted split by weight."""
    load = [Tenant("std-a", "standard", 2.0), Tenant("std-b", "standard", 2.0)]
    state = run(args, flow_settings(args), load, {"std-a": {"weight": 2}, "std-b": {"weight": 1}})
    report("on, weights std-a 2 : std-b 1, equal offered load", load, fairness=False)
    a, b = (t.window_tokens for t in load)
    ratio = a / b if b else float("inf")
    print(f"tokens served while both were backlogged: std-a {a}, std-b {b}; "
          f"split {a / max(a + b, 1):.3f} : {b / max(a + b, 1):.3f}, ratio {ratio:.2f} "
          f"(target 2.00, within 10%: {'yes' if abs(ratio / 2 - 1) <= 0.1 else 'NO'})")  # fmt: skip
    print(f"Jain's index over tokens / weight: {jain([a / 2, b / 1]):.3f}")
    report_running(state, args.slots)


def starvation(args: argparse.Namespace) -> None:
    """A batch call under interactive load that alone saturates the fleet: served within
    starvation_s plus one service time?"""
    flow = flow_settings(args)
    flow["queue"] = {"max_requests": 100_000}  # no call pushed out: only the order matters
    flow["classes"] = [
        {"name": "interactive", "ttl_s": 60.0},
        {"name": "standard", "ttl_s": 60.0},
        {"name": "batch", "ttl_s": 120.0, "starvation_s": args.starvation_s},
    ]
    chat = Tenant("chat", "interactive", 1.25)
    batch = Tenant("nightly", "batch", 0.0, at=(args.batch_at,))
    log = Path(tempfile.mkdtemp(prefix="bench-flow-")) / "gateway.log"
    state = run(args, flow, [chat, batch], log=log)
    label = f"on, batch starvation_s {args.starvation_s:g} under interactive at 1.25x"
    report(label, [chat, batch], fairness=False)
    service_s = (args.ttft_ms + args.tokens * args.token_ms) / 1000
    target = args.starvation_s + service_s
    waited = queued_s(log, "nightly-0")
    if batch.served:
        shown = "?" if waited is None else f"{waited:.2f} s"
        ok = "yes" if waited is not None and waited <= target else "NO"
        print(f"batch call (sent at +{args.batch_at:g} s): waited {shown} in the queue, first "
              f"message after {batch.first[0]:.2f} s; target starvation_s "
              f"{args.starvation_s:g} + one service time {service_s:.2f} = {target:.2f} s: "
              f"{ok}")  # fmt: skip
    else:
        refused = ", ".join(batch.refused) or "no answer"
        print(f"batch call (sent at +{args.batch_at:g} s): not served ({refused}); "
              f"target {target:.2f} s: NO")  # fmt: skip
    report_running(state, args.slots)


def requests(log: Path) -> list[dict[str, Any]]:
    """The gateway's request log lines (JSON)."""
    found = []
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "request":
            found.append(event)
    return found


def queued_s(log: Path, request_id: str) -> float | None:
    """A call's queue wait from the gateway's request log (`queued_ms`)."""
    for event in requests(log):
        if event.get("request_id") == request_id:
            queued = event.get("queued_ms")
            return None if queued is None else float(queued) / 1000
    return None


def report_waits(log: Path) -> None:
    """Queue wait p50/p99 per tenant, admitted calls (the request log's `queued_ms`)."""
    waits: dict[str, list[float]] = {}
    for event in requests(log):
        if event.get("code") == "OK" and event.get("queued_ms") is not None:
            waits.setdefault(str(event.get("tenant")), []).append(event["queued_ms"] / 1000)
    line = ", ".join(
        f"{tenant} {percentile(v, 0.5) * 1000:.0f}/{percentile(v, 0.99) * 1000:.0f} ms"
        for tenant, v in sorted(waits.items())
    )
    print(f"queue wait p50/p99 of the calls served: {line}")


SCENARIOS = {"mix": mix, "weights": weights, "starvation": starvation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--slots", type=int, default=4, help="max_inflight per worker")
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--ttft-ms", type=int, default=100)
    parser.add_argument("--token-ms", type=int, default=20)
    parser.add_argument("--std-b", type=float, default=0.6, help="std-b's share (std-a: 10x)")
    parser.add_argument("--queue", type=int, default=64, help="flow.queue.max_requests")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--starvation-s", type=float, default=2.0, help="batch starvation_s")
    parser.add_argument("--batch-at", type=float, default=2.0, help="when the batch call goes")
    args = parser.parse_args()
    for name, scenario in SCENARIOS.items():
        if args.scenario in (name, "all"):
            scenario(args)


if __name__ == "__main__":
    main()
