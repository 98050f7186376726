"""The processes the relay's end-to-end tests share (tests/e2e/test_relay*.py): one SGLang
worker, one vLLM worker and a gateway started once for a module (`fleet`, a module
fixture) and found healthy for each test (`ready`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway_sim.client import wait_health
from gateway_sim.launch import Child, SharedProcesses, worker_url
from tests.support.launch import SimHost


@dataclass(frozen=True)
class Fleet:
    sglang: Child  # model "s", named sgl-0
    vllm: Child  # model "v", named vllm-0
    gateway: Child

    @property
    def log_path(self) -> Path:
        path: Path = self.gateway.log_path  # set by the `gateway` launcher
        return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, sim_host: SimHost) -> Iterator[Fleet]:
    """One SGLang worker, one vLLM worker and a gateway, shared by the tests that leave
    them as they found them (every test checks the workers are idle again)."""
    shared = SharedProcesses(tmp_path_factory.mktemp("relay"), sim_host)
    try:
        sgl_worker, vllm_worker = shared.sims(
            ("--runtime", "sglang", "--model", "s", "--name", "sgl-0"),
            ("--runtime", "vllm", "--model", "v", "--name", "vllm-0"),
        )
        gw = shared.gateway(
            "--worker",
            worker_url(sgl_worker, model="s", runtime="sglang"),
            "--worker",
            worker_url(vllm_worker, model="v", runtime="vllm"),
        )
        yield Fleet(sgl_worker, vllm_worker, gw)
    finally:
        shared.stop()


@pytest.fixture
async def ready(fleet: Fleet) -> Fleet:
    await wait_health(fleet.gateway.address, "s")
    await wait_health(fleet.gateway.address, "v", "vllm")
    return fleet
