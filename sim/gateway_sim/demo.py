"""`gateway demo` (`make run`): a simulated fleet behind the gateway, with grpcurl lines
to paste.

The one module of `gateway_sim` that imports the gateway (it runs one in-process, and
starts the simulated workers with `gateway_sim.launch`); `gateway.cli.main` imports it only when
`gateway demo` runs."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.config import build_config
from gateway.observability.logs import configure
from gateway_sim.launch import ready, sim_args, spawn, stop_all

if TYPE_CHECKING:  # the server (numpy, the fleet) is imported only when the demo runs
    from gateway.app.server import Gateway

SGLANG_MODEL = "llama-3-8b"
VLLM_MODEL = "qwen-2.5-7b"
PD_MODEL = "deepseek-pd"
EPD_MODEL = "qwen-vl-epd"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50051", help="gateway address")
    parser.add_argument("--admin-listen", default="127.0.0.1:50052", help="admin address")
    parser.add_argument(
        "--metrics-listen", default="127.0.0.1:9464", help="Prometheus endpoint ('off': none)"
    )
    parser.add_argument("--token-ms", default="20", help="simulated delay per token (ms)")
    parser.add_argument(
        "--exit-after", type=float, default=None, help="stop by itself after this many seconds"
    )
    parser.add_argument("--log-level", default="info", help="gateway log level")


def _fleet(token_ms: str) -> list[tuple[str, list[str]]]:
    """(worker URL query, simulator flags); `{bootstrap}` and `{embedding}` in a query are
    the side ports the prefill simulator announced."""
    timing = ["--token-ms", token_ms, "--ttft-ms", "50"]
    prefill = "runtime=sglang&role=prefill&bootstrap_port={bootstrap}"
    return [
        ("runtime=sglang", ["--model", SGLANG_MODEL, "--name", "sgl-a", *timing]),
        ("runtime=sglang", ["--model", SGLANG_MODEL, "--name", "sgl-b", *timing]),
        ("runtime=vllm", ["--runtime", "vllm", "--model", VLLM_MODEL, "--name", "vllm-a", *timing]),
        (prefill, ["--role", "prefill", "--model", PD_MODEL, "--name", "pd-prefill", *timing]),
        ("runtime=sglang&role=decode", ["--role", "decode", "--model", PD_MODEL, *timing]),
        (
            prefill + "&embedding_port={embedding}",
            ["--role", "prefill", "--model", EPD_MODEL, "--name", "epd-prefill", *timing],
        ),
        ("runtime=sglang&role=decode", ["--role", "decode", "--model", EPD_MODEL, *timing]),
        (f"model={EPD_MODEL}&role=encode", ["--role", "encode", "--model", EPD_MODEL]),
    ]


def runnable(name: str) -> str:
    """A console script of this environment as a printed command can run it: its bare
    name where PATH finds this one, else its path (relative when under the current
    directory: `.venv/bin/grpcurl`)."""
    local = Path(sys.executable).parent / name
    if not local.exists():
        return name
    found = shutil.which(name)
    if found is not None and Path(found).resolve() == local.resolve():
        return name
    try:
        return str(local.relative_to(Path.cwd()))
    except ValueError:
        return str(local)


def instructions(address: str, ready_line: str) -> str:
    extra = dict(w.split("=", 1) for w in ready_line.split()[2:])
    admin, metrics = extra["admin"], extra.get("metrics")
    grpcurl, gateway = runnable("grpcurl"), runnable("gateway")
    sgl = "sglang.grpc.scheduler.SglangScheduler"
    vllm = "vllm.grpc.engine.VllmEngine"
    gen = '\'{"request_id":"r1","tokenized":{"input_ids":[1,2,3]},"stream":true,'
    return "\n".join(
        [
            f"Gateway ready on {address}. Try (Ctrl-C stops everything):",
            f"  {grpcurl} -plaintext {address} list",
            f"  {grpcurl} -plaintext {address} describe {sgl}",
            f"  {grpcurl} -plaintext {address} grpc.health.v1.Health/Check",
            f"  {grpcurl} -plaintext -H 'x-model-id: {SGLANG_MODEL}' -d "
            + gen
            + f'"sampling_params":{{"max_new_tokens":5}}}}\' {address} {sgl}/Generate',
            f"  {grpcurl} -plaintext -H 'x-model-id: {VLLM_MODEL}' -d "
            + '\'{"request_id":"r2","tokenized":{"input_ids":[1,2,3]},"stream":true,'
            + f'"sampling_params":{{"max_tokens":5}}}}\' {address} {vllm}/Generate',
            f"  {grpcurl} -plaintext -H 'x-model-id: {PD_MODEL}' -d "
            + gen
            + f'"sampling_params":{{"max_new_tokens":5}}}}\' {address} {sgl}/Generate'
            + "   # prefill + decode",
            f"  {grpcurl} -plaintext -H 'x-model-id: {EPD_MODEL}' -d "
            + '\'{"request_id":"r3","tokenized":{"input_ids":[1,2,3]},"stream":true,'
            + '"mm_inputs":{"image_urls":["http://img/cat.png"]},'
            + f'"sampling_params":{{"max_new_tokens":5}}}}\' {address} {sgl}/Generate'
            + "   # encode + prefill + decode",
            f"  {grpcurl} -plaintext -H 'x-model-id: {SGLANG_MODEL}' {address} {sgl}/GetLoads",
            f"  {grpcurl} -plaintext -v -H 'x-model-id: no-such-model' -d '{{}}' "
            f"{address} {sgl}/Generate   # a NOT_FOUND verdict",
            f"  {grpcurl} -plaintext {address} grpc.health.v1.Health/List",
            f"  {gateway} workers list --admin {admin}",
        ]
        + ([f"  curl -s http://{metrics}/metrics | grep gateway_"] if metrics else [])
    )


async def run_demo(args: argparse.Namespace) -> int:
    """Until SIGINT or SIGTERM; then everything it started is stopped. While the workers
    start, Ctrl-C is asyncio.run's (exit 130) and SIGTERM this one's (exit 143)."""
    configure("console", args.log_level)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    terminated: list[bool] = []

    def terminate() -> None:
        terminated.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    processes: list[subprocess.Popen[str]] = []
    gateway: Gateway | None = None
    try:
        fleet = _fleet(args.token_ms)
        # Every process is recorded the moment it exists, so any failure (one sim that
        # does not start, Ctrl-C while they start) stops all of them in `finally`.
        commands = [sim_args(*flags) for _, flags in fleet]
        for command in commands:
            processes.append(spawn(command))
        children = await asyncio.to_thread(
            lambda: [ready(p, command) for p, command in zip(processes, commands, strict=True)]
        )
        urls = [
            f"grpc://{child.address}?" + query.format(**child.extra)
            for (query, _), child in zip(fleet, children, strict=True)
        ]
        config = build_config(
            worker_urls=urls,
            overrides={
                "listen": args.listen,
                "admin.listen": args.admin_listen,
                "metrics.listen": args.metrics_listen,
                "drain.delay_s": 0.0,
                "drain.grace_s": 2.0,
            },
        )
        from gateway.app.server import Gateway

        gateway = Gateway(config)
        port = await gateway.start()
        host = args.listen.rpartition(":")[0]
        print(gateway.ready_line(), flush=True)
        print(instructions(f"{host}:{port}", gateway.ready_line()), flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if args.exit_after is not None:
            loop.call_later(args.exit_after, stop.set)
        await stop.wait()
        return 0
    except asyncio.CancelledError:
        if not terminated:
            raise
        return 128 + signal.SIGTERM
    finally:
        try:
            if gateway is not None:
                await gateway.drain_and_stop()
        finally:
            stop_all(processes)
