"""The simulator against a real vLLM worker's recorded answers: the same calls
(calls.py) sent to `gateway sim --runtime vllm`, started to match the recorded worker (the
tiny model's context, vocabulary and KV block size), and each answer compared with the
transcript (scripts/record_transcripts.py), what legitimately differs aside (compare.py).

GATEWAY_CONTRACT_SIM_TREE=DIR runs the simulator of another checkout (its `sim/` and
`gateway/`), e.g. a `git worktree` of an older commit, to see what the contract says
about it; GATEWAY_CONTRACT_DUMP=FILE writes the simulator's answers there (the
transcript's format) to read beside the recorded ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway_sim.launch import Child, sim_args, start
from tests.contract.calls import BLOCK_SIZE, CALLS, KV_RESTART, MAX_MODEL_LEN, MODEL, VOCAB_SIZE
from tests.contract.compare import differences, features
from tests.contract.runner import run_all

TRANSCRIPT = Path(__file__).parent / "transcripts" / "vllm-0.32.0.json"
# The simulator's load-record heartbeat here (the real servicer's: 1 s): short, but long
# enough beside the record of a call's completion (~100 ms after it) to tell them apart.
UNIT_S = 0.5
TREE = os.environ.get("GATEWAY_CONTRACT_SIM_TREE")
DUMP = os.environ.get("GATEWAY_CONTRACT_DUMP")  # a file: the simulator's answers, as JSON

# The simulator's flags for the recorded worker, each given where the simulator has it.
WANTED = (
    ("--runtime", "vllm"),
    ("--model", MODEL),
    ("--max-model-len", str(MAX_MODEL_LEN)),
    ("--vocab-size", str(VOCAB_SIZE)),
    ("--block-size", str(BLOCK_SIZE)),
    ("--kv-relay", "python"),
    ("--kv-heartbeat-ms", str(UNIT_S * 1000)),
    ("--kv-heartbeat-backoff-ms", str(UNIT_S * 5000)),  # the servicer's 5 s
)


def tree_env() -> tuple[dict[str, str] | None, str | None]:
    if TREE is None:
        return None, None
    root = str(Path(TREE).resolve())
    return {"PYTHONPATH": os.pathsep.join([root, str(Path(root) / "sim")])}, root


def sim_flags() -> list[str]:
    env, cwd = tree_env()
    shown = subprocess.run(
        [sys.executable, "-m", "gateway", "sim", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=True,
    ).stdout
    known = set(re.findall(r"--[a-z][a-z-]*", shown))
    return [word for flag, value in WANTED if flag in known for word in (flag, value)]


class Simulator:
    """A `gateway sim` process that can be killed and started again on its port."""

    def __init__(self) -> None:
        self.flags = sim_flags()
        self.child = self._start("127.0.0.1:0")
        self.port = self.child.port

    def _start(self, listen: str) -> Child:
        env, cwd = tree_env()
        return start(sim_args(*self.flags, "--listen", listen), env=env, cwd=cwd)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def restart(self) -> None:
        self.child.kill()
        self.child = await asyncio.to_thread(self._start, self.address)

    def stop(self) -> None:
        self.child.kill()


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return dict(json.loads(TRANSCRIPT.read_text())["calls"])


@pytest.fixture(scope="module")
def simulated() -> Iterator[dict[str, Any]]:
    simulator = Simulator()
    try:
        answers = asyncio.run(run_all(simulator.address, simulator.restart, UNIT_S))
    finally:
        simulator.stop()
    if DUMP:
        Path(DUMP).write_text(
            json.dumps({"sim_flags": simulator.flags, "calls": answers}, indent=1)
        )
    yield answers


NAMES = [call.name for call in CALLS] + [KV_RESTART.name]


def test_the_transcript_has_every_call(recorded: dict[str, Any]) -> None:
    assert sorted(recorded) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_simulator_answers_as_the_real_worker(
    name: str, recorded: dict[str, Any], simulated: dict[str, Any]
) -> None:
    found = differences(features(name, recorded[name]), features(name, simulated[name]))
    assert not found, f"{name}: the simulator differs from vLLM 0.32.0:\n" + "\n".join(found)
