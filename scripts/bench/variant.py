"""The A/B comparison of scripts/bench/bench.py (`--variant-arg`, `--variant-env`,
`--variant-tree`): the gateway as configured and a variant, in alternation in the same
run, their CPU per message compared."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from load_clients import cpu_per_message, run_one
from processes import gateway_args, start_otlp_sink

from gateway_sim.launch import Child, start


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
