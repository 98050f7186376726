"""Simulated workers as real processes for the simulator's own tests.

Started with `gateway.launch.start_sim` (the same launcher the gateway's end-to-end tests,
the demo and the benchmark use); every process is stopped when its fixture ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gateway.launch import Child, start_sim

SimProcess = Child


@pytest.fixture(name="start_sim")
def start_sim_fixture() -> Iterator[Callable[..., Child]]:
    """Factory fixture: ``start_sim("--runtime", "vllm") -> Child``."""
    started: list[Child] = []

    def start(*args: str) -> Child:
        child = start_sim(*args)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


@pytest.fixture(scope="module")
def sglang_sim() -> Iterator[Child]:
    """One SGLang sim shared by a module's read-mostly tests."""
    child = start_sim("--runtime", "sglang", "--name", "sgl-shared", "--dp-ranks", "2")
    yield child
    child.kill()


@pytest.fixture(scope="module")
def vllm_sim() -> Iterator[Child]:
    """One vLLM sim shared by a module's read-mostly tests."""
    child = start_sim("--runtime", "vllm", "--name", "vllm-shared", "--model", "tiny")
    yield child
    child.kill()
