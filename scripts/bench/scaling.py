"""`scripts/bench/bench.py --processes N`: the gateway phase once per serving-process count
1..N (a fresh `gateway serve --processes k` each) against the direct limit, each group of
processes pinned to its own cores where the machine has enough."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from load_clients import Load, Result, cpu_per_message, run_one
from proc_cpu import children, connections_per_process
from processes import gateway_args, stop_gateway

from gateway_sim.launch import Child, start, start_sim


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
    cpu: float = sum(result.cpu.get(name, 0.0) for name in names)
    wall: float = result.seconds
    return cpu / wall


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
