#!/usr/bin/env python3
"""Discovery flood benchmark: what N discovered hosts that never answer cost a gateway,
and whether it gets its memory and threads back once they are gone.

Not a test. Starts one simulated worker and `gateway serve` with a file source that
lists it; then rewrites the file to list N more hosts on closed ports of 127.0.0.1
(bound, never listening: every connection is refused), then the one worker again. In
each phase a client sends calls one after another for `--window` seconds, and the
gateway process's RSS, thread count and /metrics size are read from outside (/proc).

    python scripts/bench/bench_discovery.py                          # 2000 hosts: refused
    python scripts/bench/bench_discovery.py --hosts 255 --named      # the most a source takes
    python scripts/bench/bench_discovery.py --named --max-hosts 4000 # 2000 hosts, let in

`--named`: the hosts' URLs name model and runtime, so they register (probes, load polls,
metrics series) instead of waiting to be asked what they serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.admin.v1 import admin_pb2_grpc
from gateway_sim.launch import Child, start, start_sim, stop_all

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def metrics_bytes(gw: Child) -> int:
    url = f"http://127.0.0.1:{gw.port_of('metrics')}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return len(response.read())


async def workers(gw: Child) -> int:
    async with aio.insecure_channel(gw.extra["admin"]) as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        reply = await stub.ListWorkers(admin_pb.ListWorkersRequest(), timeout=30)
    return len(reply.workers)


async def calls(gw: Child, window_s: float) -> tuple[int, int]:
    """(calls made, calls that succeeded) in `window_s`, one after another."""
    request = sgl.GenerateRequest(
        request_id="bench",
        tokenized=sgl.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=sgl.SamplingParams(max_new_tokens=1),
        stream=False,
    )
    made = ok = 0
    async with aio.insecure_channel(gw.address) as ch:
        generate = ch.unary_unary(
            GENERATE, request_serializer=sgl.GenerateRequest.SerializeToString
        )
        end = time.monotonic() + window_s
        while time.monotonic() < end:
            made += 1
            try:
                await generate(request, metadata=(("x-model-id", "m"),), timeout=2)
                ok += 1
            except aio.AioRpcError:
                pass
    return made, ok


async def phase(name: str, gw: Child, window_s: float) -> dict[str, float]:
    made, ok = await calls(gw, window_s)
    pid = gw.process.pid
    figures = {
        "calls": made,
        "ok": ok,
        "rss_mib": round(rss_mib(pid), 1),
        "threads": threads(pid),
        "metrics_bytes": await asyncio.to_thread(metrics_bytes, gw),
        "workers": await workers(gw),
    }
    print(f"{name:>9}: {json.dumps(figures)}", flush=True)
    return figures


async def wait_workers(gw: Child, count: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await workers(gw) == count:
            return True
        await asyncio.sleep(0.5)
    return False


async def run(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.hosts + 256)), hard))
    closed: list[socket.socket] = []  # bound after the processes start (select: fd < 1024)
    children: list[Child] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            worker = start_sim("--model", "m")
            children.append(worker)
            one = [f"grpc://{worker.address}?model=m&runtime=sglang"]
            listed = Path(tmp) / "workers.yaml"
            listed.write_text(yaml.safe_dump(one))
            source: dict[str, object] = {"source": "file", "path": str(listed), "interval_s": 1}
            if args.max_hosts is not None:
                source["max_hosts"] = args.max_hosts
            config = Path(tmp) / "gateway.yaml"
            config.write_text(yaml.safe_dump({"discovery": [source]}))
            gw = start(
                ["serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                 "--metrics-listen", "127.0.0.1:0", "--drain-delay", "0", "--config", str(config)],
            )  # fmt: skip
            children.append(gw)
            await wait_workers(gw, 1, 20)
            await asyncio.sleep(args.settle)
            await phase("baseline", gw, args.window)
            for _ in range(args.hosts):
                closed.append(socket.socket())
                closed[-1].bind(("127.0.0.1", 0))
            query = "?model=m&runtime=sglang" if args.named else ""
            flood = one + [f"grpc://127.0.0.1:{s.getsockname()[1]}{query}" for s in closed]
            listed.write_text(yaml.safe_dump(flood))
            await asyncio.sleep(2)
            await phase("flood", gw, args.window)
            listed.write_text(yaml.safe_dump(one))
            if not await wait_workers(gw, 1, 60):
                print("the hosts did not all leave within 60 s")
            await asyncio.sleep(args.settle)
            await phase("after", gw, args.window)
        finally:
            stop_all([c.process for c in reversed(children)])
            for sock in closed:
                sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2000)
    parser.add_argument("--max-hosts", type=int, default=None, help="the source's max_hosts")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of calls a phase")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before a phase")
    parser.add_argument(
        "--named", action="store_true", help="hosts name model and runtime (they register)"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
