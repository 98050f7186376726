"""`scripts/bench/bench.py --mode picker`: the gateway's relay against Envoy with the
gateway as its endpoint picker, Envoy with the floor picker, Envoy alone and the bare
relay, in alternation on one worker; CPU per relayed message of each, and the ratios
against their targets."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from bench_picker import expect_stream, picker_bootstrap, start_envoy, static_bootstrap
from load_clients import GENERATE, Result, alternate, cpu_per_message, request_bytes
from processes import gateway_args, start_bare_relay, start_floor_picker

from gateway_sim.launch import Child, start, start_sim

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
    seconds: float = sum(cpu_per_message(result, name) for name in names)
    return seconds


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
