"""The gateway as a process: one line for a port it cannot bind, signals that stop it
promptly and quietly, and --version."""

from __future__ import annotations

import asyncio
import json
import select
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest

from gateway_sim.client import (
    channel,
    dead_worker_url,
    model_md,
    running_on_sim,
    sgl_generate,
    sgl_grpc,
    wait_health,
)
from gateway_sim.launch import SERVE_ARGS, Child, ready, spawn, worker_url
from tests.support.launch import ROOT, Launcher


@pytest.fixture
def busy() -> Iterator[socket.socket]:
    """A port another process listens on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


@pytest.mark.parametrize("flag", ["--listen", "--admin-listen", "--metrics-listen"])
def test_a_port_that_cannot_be_bound_is_one_line_and_exit_2(flag: str, busy: socket.socket) -> None:
    address = f"127.0.0.1:{busy.getsockname()[1]}"
    args = dict(zip(SERVE_ARGS[1::2], SERVE_ARGS[2::2], strict=False))
    args[flag] = address
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", *(x for kv in args.items() for x in kv)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    # JSON logs (SERVE_ARGS): one JSON line, not grpc core's own line besides it.
    (line,) = result.stderr.splitlines()
    error = json.loads(line)
    assert error["event"].startswith(f"cannot listen on {address}: ")
    assert error["level"] == "error"
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# A drain delay far longer than any wait below: a process that ends within the wait
# skipped it (no clock is read).
DELAYED = (*SERVE_ARGS[:5], "--metrics-listen", "off", "--drain-delay", "120")


def _serve(*args: str) -> Child:
    command = [*DELAYED, *args]
    return ready(spawn(command, stderr=subprocess.PIPE), command)


def test_sigint_with_nothing_in_flight_skips_the_drain_delay(sim: Launcher) -> None:
    worker = sim("--model", "m")
    gw = _serve("--worker", worker_url(worker, model="m", runtime="sglang"))
    try:
        gw.process.send_signal(signal.SIGINT)
        assert gw.process.wait(timeout=60) == 0  # not the 120 s drain delay
        assert gw.process.stderr is not None and "Traceback" not in gw.process.stderr.read()
    finally:
        gw.stop()


async def test_a_second_signal_stops_at_once_whatever_is_in_flight(sim: Launcher) -> None:
    worker = sim("--model", "m", "--ttft-ms", "30000")
    gw = _serve("--worker", worker_url(worker, model="m", runtime="sglang"))
    stderr = gw.process.stderr
    assert stderr is not None
    try:
        await wait_health(gw.address, "m")  # the worker is ready: the call is placed
        async with channel(gw.address) as ch:
            call = sgl_grpc.SglangSchedulerStub(ch).Generate(sgl_generate(), metadata=model_md("m"))
            for _ in range(200):  # bounded: until the worker has the call
                if await running_on_sim(worker.address) == 1:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the call never reached the worker")
            gw.process.send_signal(signal.SIGINT)  # in flight: the drain delay applies
            draining = next(
                (line for line in iter(stderr.readline, "") if "draining" in line), ""
            )  # ends at the draining line, or at EOF if the process died
            assert "delay_s=120" in draining, draining
            assert gw.process.poll() is None
            gw.process.send_signal(signal.SIGINT)
            assert gw.process.wait(timeout=60) == 0  # not the drain delay
            call.cancel()
        rest = stderr.read()
        assert "stopping now: second signal" in rest and "Traceback" not in rest
    finally:
        gw.stop()


def _wait_connected(sock: socket.socket, process: subprocess.Popen[str]) -> None:
    """Until the gateway connects to the worker `sock` listens as (it is then waiting for
    discovery, past its imports and its config): a state, not a sleep."""
    deadline = time.monotonic() + 60  # a safety net only
    while not select.select([sock], [], [], 0.1)[0]:
        assert process.poll() is None, (
            f"the gateway ended ({process.returncode}) before it connected: "
            f"{process.stderr.read()[-2000:] if process.stderr else ''}"
        )
        assert time.monotonic() < deadline, "the gateway never connected to its worker"


def _start_waiting(ignore: tuple[signal.Signals, ...] = ()) -> tuple[socket.socket, Any]:
    """A gateway waiting, at start-up, for a worker that accepts and never answers;
    started with `ignore` ignored (as a background job of a non-interactive shell is)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    command = [sys.executable, "-m", "gateway", *SERVE_ARGS, "--worker", dead_worker_url(sock)]
    if ignore:
        # A shell ignores them and execs the gateway, which starts with them ignored (no
        # preexec_fn: Python code between fork and exec in this threaded process can
        # abort the child before it runs).
        names = " ".join(sig.name.removeprefix("SIG") for sig in ignore)
        command = ["sh", "-c", f'trap "" {names}; exec "$@"', "sh", *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return sock, process


@pytest.mark.parametrize("ignored", [(), (signal.SIGINT, signal.SIGTERM)], ids=["", "ignored"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_signal_during_start_up_stops_quietly(
    sig: signal.Signals, ignored: tuple[signal.Signals, ...]
) -> None:
    """Start-up waits for a worker that never answers; a signal then stops the process
    long before discovery would give up, with no traceback, also when the process was
    started with the signal ignored (its default is restored at start)."""
    sock, process = _start_waiting(ignored)
    try:
        _wait_connected(sock, process)
        process.send_signal(sig)
        code = process.wait(timeout=30)  # discovery would wait far longer
        assert code in (0, 128 + sig)
        assert process.stderr is not None and "Traceback" not in process.stderr.read()
        assert process.stdout is not None and "READY" not in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        sock.close()


def test_version() -> None:
    """The installed distribution's version, which is pyproject.toml's."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--version"], capture_output=True, text=True, check=True
    )
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert result.stdout == f"gateway {declared}\n"
