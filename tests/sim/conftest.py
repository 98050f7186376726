"""Simulated workers for the simulator's own tests.

Hosted (tests/e2e/simhost.py, see tests/conftest.py): the same `gateway_sim` server, over
real protos, without a Python process started for each. A test of the process itself
(its signals, its exit) is marked `sim_processes` and gets `gateway sim` processes,
started with `gateway_sim.launch.start_sim` (the launcher the gateway's end-to-end tests, the
demo and the benchmark use). Every worker is stopped when its fixture ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway_sim.launch import START_S, Child, start_sim
from tests.support.launch import HostedSim, SimHost

SimProcess = Child | HostedSim


@pytest.fixture(name="start_sim")
def start_sim_fixture(
    request: pytest.FixtureRequest, sim_host: SimHost
) -> Iterator[Callable[..., Any]]:
    """Factory fixture: ``start_sim("--runtime", "vllm") -> Child | HostedSim``."""
    processes = request.node.get_closest_marker("sim_processes") is not None
    started: list[Child | HostedSim] = []

    def start(*args: str) -> Child | HostedSim:
        worker = start_sim(*args, timeout=START_S) if processes else sim_host.start(*args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if isinstance(worker, HostedSim):
            worker.stop()
        else:
            worker.kill()


@pytest.fixture(scope="module")
def sglang_sim(sim_host: SimHost) -> Iterator[HostedSim]:
    """One SGLang sim shared by a module's read-mostly tests."""
    worker = sim_host.start("--runtime", "sglang", "--name", "sgl-shared", "--dp-ranks", "2")
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def vllm_sim(sim_host: SimHost) -> Iterator[HostedSim]:
    """One vLLM sim shared by a module's read-mostly tests."""
    worker = sim_host.start("--runtime", "vllm", "--name", "vllm-shared", "--model", "tiny")
    yield worker
    worker.stop()
