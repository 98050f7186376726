"""The simulator against real vLLM and SGLang workers' recorded answers: each engine's
calls (calls.py) sent to `gateway sim --runtime vllm|sglang`, started to match the
recorded worker (the tiny model's context, vocabulary, KV block or page size), and each
answer compared with the transcript (scripts/record_transcripts.py), what legitimately
differs aside (compare.py). Each engine's calls run in an xdist group of their own, so
both engines' simulators run side by side.

GATEWAY_CONTRACT_SIM_TREE=DIR runs the simulator of another checkout (its `sim/` and
`gateway/`), e.g. a `git worktree` of an older commit, to see what the contract says
about it; GATEWAY_CONTRACT_DUMP=FILE writes the simulator's answers beside it, one file per
engine (`answers.json`: `answers-vllm.json`, `answers-sglang.json`; the transcript's
format) to read beside the recorded ones.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway_sim.launch import Child, sim_args, start
from tests.contract.calls import CONTRACTS, MAX_MODEL_LEN, MODEL, VOCAB_SIZE, Contract
from tests.contract.compare import differences, features
from tests.contract.runner import run_all

TRANSCRIPTS = Path(__file__).parent / "transcripts"
# The simulator's load-record heartbeat here (the real servicer's: 1 s): short, but long
# enough beside the record of a call's completion (~100 ms after it) to tell them apart.
UNIT_S = 0.5
TREE = os.environ.get("GATEWAY_CONTRACT_SIM_TREE")
DUMP = os.environ.get("GATEWAY_CONTRACT_DUMP")  # a file: the simulator's answers, as JSON


def wanted(contract: Contract) -> tuple[tuple[str, ...], ...]:
    """The simulator's flags for the recorded worker, each given where the simulator
    has it."""
    flags = (
        ("--runtime", contract.engine),
        ("--model", MODEL),
        ("--max-model-len", str(MAX_MODEL_LEN)),
        ("--vocab-size", str(VOCAB_SIZE)),
        ("--block-size", str(contract.block_size)),
    )
    if contract.kv is None:
        # No KV events (the recorded SGLang worker is started without them), and its KV
        # pool's size in pages of one token.
        kv_tokens = str(recorded_kv_tokens(contract.engine))
        return (*flags, ("--kv-blocks", kv_tokens), ("--no-kv-events",))
    return (
        *flags,
        ("--kv-relay", "python"),
        ("--kv-heartbeat-ms", str(UNIT_S * 1000)),
        ("--kv-heartbeat-backoff-ms", str(UNIT_S * 5000)),  # the servicer's 5 s
    )


def tree_env() -> tuple[dict[str, str] | None, str | None]:
    if TREE is None:
        return None, None
    root = str(Path(TREE).resolve())
    return {"PYTHONPATH": os.pathsep.join([root, str(Path(root) / "sim")])}, root


def sim_flags(contract: Contract) -> list[str]:
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
    return [word for flag in wanted(contract) if flag[0] in known for word in flag]


class Simulator:
    """A `gateway sim` process that can be killed and started again on its port."""

    def __init__(self, contract: Contract) -> None:
        self.flags = sim_flags(contract)
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


def engine_param(engine: str, *rest: str) -> Any:
    """A case of `engine`'s contract, in the xdist group of that engine."""
    group = pytest.mark.xdist_group(f"tests/contract/test_transcripts.py::{engine}")
    return pytest.param(engine, *rest, id="-".join((engine, *rest)), marks=group)


@functools.cache
def transcript(engine: str) -> dict[str, Any]:
    return dict(json.loads((TRANSCRIPTS / CONTRACTS[engine].transcript).read_text()))


def recorded(engine: str) -> dict[str, Any]:
    return dict(transcript(engine)["calls"])


def recorded_kv_tokens(engine: str) -> int:
    """The recorded worker's KV pool, in tokens (SGLang's --max-total-tokens)."""
    args: list[str] = transcript(engine)["worker"]["args"]
    return int(args[args.index("--max-total-tokens") + 1])


def simulate(contract: Contract) -> dict[str, Any]:
    """The simulator's answers to the contract's calls; the simulator is gone after."""
    simulator = Simulator(contract)
    try:
        answers = asyncio.run(run_all(simulator.address, contract, simulator.restart, UNIT_S))
    finally:
        simulator.stop()
    if DUMP:
        dump = Path(DUMP)  # one file per engine: FILE's stem, then the engine
        dump = dump.with_name(f"{dump.stem}-{contract.engine}{dump.suffix}")
        dump.write_text(json.dumps({"sim_flags": simulator.flags, "calls": answers}, indent=1))
    return answers


@pytest.fixture(scope="module")
def simulated() -> Callable[[str], dict[str, Any]]:
    """Each engine's answers, its simulator run once, on first use: a fixture
    parametrized by engine would be set up again whenever the engine of the next test
    changed (pytest keeps one parameter's instance at a time)."""
    return functools.cache(lambda engine: simulate(CONTRACTS[engine]))


@pytest.mark.parametrize("engine", [engine_param(engine) for engine in CONTRACTS])
def test_the_transcript_has_every_call(engine: str) -> None:
    assert sorted(recorded(engine)) == sorted(CONTRACTS[engine].names)


@pytest.mark.parametrize(
    ("engine", "name"),
    [engine_param(engine, name) for engine, c in CONTRACTS.items() for name in c.names],
)
def test_the_simulator_answers_as_the_real_worker(
    engine: str, name: str, simulated: Callable[[str], dict[str, Any]]
) -> None:
    contract = CONTRACTS[engine]
    found = differences(
        features(contract, name, recorded(engine)[name]),
        features(contract, name, simulated(engine)[name]),
    )
    version = contract.transcript.removesuffix(".json")
    assert not found, f"{name}: the simulator differs from {version}:\n" + "\n".join(found)
