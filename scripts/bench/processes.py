"""The processes a benchmark starts besides the simulated workers: the gateway's command
line, the floors (the bare relay, the floor picker), the trace sink; and a gateway
stopped with every serving process it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gateway_sim.launch import Child, ready

SERVING = b"gateway.scale.child"  # in a serving process's command line


def start_bare_relay(upstream: str) -> Child:
    """The bare grpc.aio relay (scripts/bench/bare_relay.py) in front of `upstream`."""
    command = [sys.executable, str(Path(__file__).with_name("bare_relay.py"))]
    process = subprocess.Popen(
        [*command, "--upstream", upstream], stdout=subprocess.PIPE, text=True
    )
    return ready(process, ["bare_relay", upstream])


def start_floor_picker(upstream: str) -> Child:
    """The cheapest grpc.aio picker (scripts/bench/floor_picker.py), naming `upstream` (IP:PORT)
    for every call."""
    command = [sys.executable, str(Path(__file__).with_name("floor_picker.py"))]
    process = subprocess.Popen(
        [*command, "--upstream", upstream], stdout=subprocess.PIPE, text=True
    )
    return ready(process, ["floor_picker", upstream])


def start_otlp_sink() -> Child:
    """A trace receiver that counts and drops (scripts/otlp_sink.py)."""
    command = [sys.executable, str(Path(__file__).resolve().parents[1] / "otlp_sink.py")]
    return ready(subprocess.Popen(command, stdout=subprocess.PIPE, text=True), ["otlp_sink"])


def alive_serving(pid: int) -> bool:
    try:
        return SERVING in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def stop_gateway(gateway: Child, serving: set[int]) -> None:
    """Stop the supervisor (it drains and stops its serving processes); then end any
    serving process it left behind (only the pids it started, checked by command line)."""
    gateway.stop()
    left = [pid for pid in serving if alive_serving(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if alive_serving(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def gateway_args(worker_urls: list[str], extra: list[str], processes: int) -> list[str]:
    return [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
        "--log-level",
        "warning",
        "--processes",
        str(processes),
        *worker_urls,
        *extra,
    ]
