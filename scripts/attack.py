#!/usr/bin/env python3
"""Attack harness: what an attack on the gateway costs a legitimate client.

Not a test. Each scenario starts its own simulated workers and a gateway (real processes
on 127.0.0.1), then measures for `--baseline-s` (5) seconds without the attack and for
`--attack-s` (10) seconds while it lasts:

- a legitimate client, a process of its own, calling another model on its own simulated
  worker (two loops of small streamed Generate calls): calls OK, latency p50/p90/p99;
- a health prober, a process of its own, calling `grpc.health.v1.Health/Check` (service
  "") every 20 ms: how much later than 20 ms an answer came after the one before, the
  gateway's event loop stalling (max, p99);
- the gateway's RSS (/proc/PID/status VmRSS) and threads at the end of the baseline, at
  their peak, and after the attack ended (the scenario waits for the state it leaves, then
  the run settles: 3 s, 20 s for queue-memory).

It prints each scenario's figures as it ends, and a table, one line a scenario, with the
pass criteria: legit >= 99% OK during the attack, its p99 <= 2x the baseline's, the
longest stall <= 100 ms, RSS after <= 20 MiB over the baseline; and the scenario's own
where it has one (PASS/FAIL each). Every process a scenario starts is stopped when it
ends, however it ends (Ctrl-C included).

    python scripts/attack.py all
    python scripts/attack.py flow-queue usage
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts.attacks, and the tests' helpers it reuses

from scripts.attacks import measure  # noqa: E402
from scripts.attacks.harness import ATTACK_S, BASELINE_S, drive  # noqa: E402
from scripts.attacks.outcome import TABLE_HEAD, Outcome, detail, table_line  # noqa: E402
from scripts.attacks.scenarios import CALIBRATION, SCENARIOS  # noqa: E402

OBSERVERS = ("_legit", "_health")  # the observer processes the harness starts
KINDS = {**SCENARIOS, **CALIBRATION}


async def run_all(
    names: list[str], baseline_s: float, attack_s: float, tree: Path | None
) -> list[Outcome]:
    outcomes = []
    for name in names:
        kind = KINDS[name]
        try:
            outcome = await drive(kind, baseline_s, attack_s, tree)
        except Exception as exc:  # one broken scenario must not hide the others' figures
            traceback.print_exc()
            outcome = Outcome(name, kind.summary, skipped=f"did not run: {exc!r}")
        print(detail(outcome), flush=True)
        outcomes.append(outcome)
    return outcomes


def share_bytecode() -> str | None:
    """Where PYTHONDONTWRITEBYTECODE is set, the processes of a run share one bytecode
    cache in a directory of the run (as the tests do): else each of them compiles the
    gateway's and the simulator's sources again, seconds of a small machine's CPU per
    scenario. The directory, if one was made."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or "PYTHONPYCACHEPREFIX" in os.environ:
        return None
    directory = tempfile.mkdtemp(prefix="attack-pycache-")
    os.environ["PYTHONPYCACHEPREFIX"] = directory
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    return directory


def interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as Ctrl-C: the runs stop what they started on the way out."""
    raise KeyboardInterrupt


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in OBSERVERS:
        measure.main(sys.argv[1], sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        epilog="scenarios (all: every one but idle):\n"
        + "\n".join(f"  {n}: {k.summary}" for n, k in KINDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("scenarios", nargs="+", choices=[*KINDS, "all"], metavar="SCENARIO")
    parser.add_argument("--baseline-s", type=float, default=BASELINE_S)
    parser.add_argument("--attack-s", type=float, default=ATTACK_S)
    parser.add_argument(
        "--gateway-tree",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the gateway from the code in DIR (e.g. `git archive HEAD gateway | tar -x "
        "-C DIR`: the figures before a change); the simulator and the clients stay these",
    )
    args = parser.parse_args()
    asked = [n for n in args.scenarios if n != "all"]
    names = list(dict.fromkeys([*(SCENARIOS if "all" in args.scenarios else ()), *asked]))
    signal.signal(signal.SIGTERM, interrupted)
    bytecode = share_bytecode()
    try:
        tree = args.gateway_tree.resolve() if args.gateway_tree else None
        outcomes = asyncio.run(run_all(names, args.baseline_s, args.attack_s, tree))
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        sys.exit(130)
    finally:
        if bytecode is not None:
            shutil.rmtree(bytecode, ignore_errors=True)
    print()
    print(TABLE_HEAD)
    for outcome in outcomes:
        print(table_line(outcome))


if __name__ == "__main__":
    main()
