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

    python scripts/bench_flow.py --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.launch import Child, start, start_sim, stop_all

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


async def one_call(stub: sgl_grpc.SglangSchedulerStub, tenant: Tenant, tokens: int, i: int) -> None:
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
    try:
        async for message in stub.Generate(request, metadata=metadata, timeout=120):
            if first is None:
                first = time.monotonic() - started
            if message.WhichOneof("response") == "chunk":
                chunks += 1
    except aio.AioRpcError as error:
        tenant.refused[reason_of(error)] += 1
        return
    tenant.served += 1
    tenant.tokens += chunks
    if first is not None:
        tenant.first.append(first)


async def offer(
    address: str, load: list[Tenant], capacity: float, duration: float, tokens: int
) -> None:
    rng = random.Random(7)
    async with aio.insecure_channel(address) as channel:
        stub = sgl_grpc.SglangSchedulerStub(channel)
        calls: set[asyncio.Task[None]] = set()

        async def arrivals(tenant: Tenant) -> None:
            rate = tenant.share * capacity
            end = time.monotonic() + duration
            i = 0
            while time.monotonic() < end:
                task = asyncio.ensure_future(one_call(stub, tenant, tokens, i))
                calls.add(task)
                task.add_done_callback(calls.discard)
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


def report(label: str, load: list[Tenant]) -> None:
    print(f"\n== flow control {label}")
    print(f"{'tenant':8} {'class':12} {'offered':>8} {'served':>7} {'tokens':>7} "
          f"{'ttft p50':>9} {'ttft p99':>9}  refused")  # fmt: skip
    for t in load:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(t.refused.items())) or "-"
        p50, p99 = percentile(t.first, 0.5), percentile(t.first, 0.99)
        print(f"{t.name:8} {t.klass:12} {t.offered:8} {t.served:7} {t.tokens:7} "
              f"{p50 * 1000:8.0f}ms {p99 * 1000:8.0f}ms  {refused}")  # fmt: skip
    standard = [float(t.tokens) for t in load if t.klass == "standard"]
    print(f"Jain's index, standard tenants' served tokens: {jain(standard):.3f}")


def run(args: argparse.Namespace, flow: bool) -> list[Tenant]:
    directory = Path(tempfile.mkdtemp(prefix="bench-flow-"))
    workers = [
        start_sim("--model", "m", "--ttft-ms", str(args.ttft_ms), "--token-ms", str(args.token_ms))
        for _ in range(2)
    ]
    config: dict[str, object] = {
        "workers": [f"grpc://{w.address}?model=m&runtime=sglang" for w in workers],
        "models": {"m": {"max_inflight": args.slots}},
    }
    if flow:  # short waits, a small queue: the run ends soon after the load does
        config["flow"] = {
            "trust_tenant_header": True,
            "queue": {"max_requests": args.queue},
            "classes": [
                {"name": "interactive", "ttl_s": 10.0},
                {"name": "standard", "ttl_s": 10.0},
                {"name": "batch", "ttl_s": 20.0, "starvation_s": 5.0},
            ],
        }
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    listen = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
    gateway: Child = start(["serve", "--config", str(path), *listen, "--metrics-listen", "off"])
    service_s = (args.ttft_ms + args.tokens * args.token_ms) / 1000
    capacity = 2 * args.slots / service_s
    load = tenants(args.std_b)
    try:
        asyncio.run(offer(gateway.address, load, capacity, args.duration, args.tokens))
    finally:
        stop_all([gateway.process, *(w.process for w in workers)])
    print(f"\ncapacity {capacity:.1f} calls/s (2 workers x {args.slots} slots, "
          f"service {service_s * 1000:.0f} ms)")  # fmt: skip
    return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--slots", type=int, default=4, help="max_inflight per worker")
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--ttft-ms", type=int, default=100)
    parser.add_argument("--token-ms", type=int, default=20)
    parser.add_argument("--std-b", type=float, default=0.6, help="std-b's share (std-a: 10x)")
    parser.add_argument("--queue", type=int, default=64, help="flow.queue.max_requests")
    args = parser.parse_args()
    report("off", run(args, flow=False))
    report("on", run(args, flow=True))


if __name__ == "__main__":
    main()
