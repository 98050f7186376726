"""What a log pipeline gets from a real `gateway serve --log-format json`: nothing but
JSON lines on stderr, grpc core's own lines included (a failed TLS handshake, a port in
use), alone and with `--processes 2`, every line's `process` a string there; and a worker
leaving service is a warning, its return info."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trustme

from gateway_sim.launch import SERVE_ARGS, START_S, Child, start, worker_url
from tests.support.launch import STOP_S, Launcher

WAIT_S = 30.0  # a safety net for every bounded wait: only a hang reaches it
POLL_S = 0.05
# grpc core logs a failed handshake at INFO: make sure it does, whatever the environment.
VERBOSE = {"GRPC_VERBOSITY": "INFO"}


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of `text` as JSON (fails on the first line that is not)."""
    parsed = []
    for line in text.splitlines():
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line on stderr: {line!r}")
    return parsed


def wait_line(log: Path, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first logged line `wanted` accepts, once it is written (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [e for e in json_lines(log.read_text()) if wanted(e)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "the line was not logged"
        time.sleep(POLL_S)


def plaintext_hello(port: int) -> None:
    """A client speaking plaintext to a TLS port: the server's handshake fails."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: gateway\r\n\r\n")
        while sock.recv(4096):  # until the server hangs up
            pass


def is_handshake_failure(event: dict[str, Any]) -> bool:
    return event.get("logger") == "grpc" and "Handshake failed" in event["event"]


@pytest.fixture
def tls(tmp_path: Path) -> tuple[str, ...]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(tmp_path / "server.key")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "server.pem")
    return ("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"))


def serve_to_exit(processes: str, flag: str, address: str) -> list[dict[str, Any]]:
    """`gateway serve` on a port in use: its stderr's lines (it exits 2)."""
    args = dict(zip(SERVE_ARGS[1::2], SERVE_ARGS[2::2], strict=True))
    args[flag] = address
    flags = [x for kv in args.items() for x in kv]
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", *flags, "--processes", processes],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **VERBOSE},
    )
    assert result.returncode == 2, result.stderr
    return json_lines(result.stderr)


@pytest.mark.parametrize("count", ["1", "2"])
def test_json_mode_writes_nothing_but_json_lines_on_stderr(
    count: str, tls: tuple[str, ...], tmp_path: Path, processes: list[Child]
) -> None:
    log = tmp_path / "gateway.log"
    with log.open("w") as stderr:
        gw = start(
            [*SERVE_ARGS, *tls, "--processes", count],
            stderr=stderr.fileno(),
            env=VERBOSE,
            timeout=START_S,
        )
    processes.append(gw)
    # grpc core's line for a failed handshake (with two processes, on whichever took the
    # connection): a record of the gateway's logger.
    deadline = time.monotonic() + WAIT_S
    while not [e for e in json_lines(log.read_text()) if is_handshake_failure(e)]:
        assert time.monotonic() < deadline, "no handshake failure was logged"
        plaintext_hello(gw.port)
        time.sleep(POLL_S)
    # A port in use (the main port; the admin port, which grpc binds too): the gateway's
    # own line, once, and not grpc core's besides it.
    for flag, port in (("--listen", gw.port), ("--admin-listen", gw.port_of("admin"))):
        address = f"127.0.0.1:{port}"
        lines = serve_to_exit(count, flag, address)
        (error,) = [e for e in lines if e["level"] == "error"]
        assert error["event"].startswith(f"cannot listen on {address}: ")
        assert not [e for e in lines if e.get("file", "").startswith("add_port.cc")], lines
    assert gw.stop(STOP_S) == 0
    lines = json_lines(log.read_text())
    failed = [e for e in lines if is_handshake_failure(e)]
    assert failed and {e["level"] for e in failed} == {"info"}
    assert all(e["file"].startswith("ssl_transport_security.cc:") for e in failed)
    # No worker: said once, as a warning (by the first serving process of several).
    unusable = [e for e in lines if e["event"] == "no_usable_workers"]
    assert [(e["level"], e["models"], e.get("process")) for e in unusable] == [
        ("warning", [], None if count == "1" else "0")
    ]
    if count == "2":
        assert {type(e["process"]) for e in lines} == {str}
        assert {e["process"] for e in failed} <= {"0", "1"}
        serving = [e for e in lines if e["event"] == "serving" and e["process"] != "supervisor"]
        assert len(serving) == 2 and not [e for e in serving if "admin_port" in e]
        assert all(e["control"].startswith("unix:") for e in serving)


@pytest.mark.sim_processes  # signalled to flip its health
def test_a_worker_leaving_service_is_a_warning_and_its_return_info(
    sim: Launcher, gateway: Launcher
) -> None:
    worker = sim("--model", "m")
    gw = gateway(
        "--probe-interval", "0.1", "--worker", worker_url(worker, model="m", runtime="sglang")
    )
    log: Path = gw.log_path

    def status(old: str, new: str) -> Callable[[dict[str, Any]], bool]:
        return lambda e: e["event"] == "worker_status" and (e["old"], e["new"]) == (old, new)

    wait_line(log, status("pending", "ready"))
    worker.process.send_signal(signal.SIGUSR1)  # grpc.health NOT_SERVING
    left = wait_line(log, status("ready", "not_ready"))
    assert left["level"] == "warning" and left["worker"] == worker.address
    worker.process.send_signal(signal.SIGUSR2)  # SERVING again
    back = wait_line(log, status("not_ready", "ready"))
    assert back["level"] == "info"
