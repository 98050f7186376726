"""The simulator against real vLLM and SGLang workers' recorded answers: each contract's
calls (calls.py: each engine's regular worker, and each engine's prefill/decode pair) sent
to `gateway sim --runtime vllm|sglang` (two of them, `--role prefill` and `--role decode`,
for a pair), started to match the recorded workers (the tiny model's context, vocabulary,
KV block or page size), and each answer compared with the transcript
(tests/contract/record.py), what legitimately differs aside (compare.py). Each
contract's calls run in an xdist group of their own, so the simulators run side by side.

GATEWAY_CONTRACT_SIM_TREE=DIR runs the simulator of another checkout (its `sim/` and
`gateway/`), e.g. a `git worktree` of an older commit, to see what the contract says
about it; GATEWAY_CONTRACT_DUMP=FILE writes the simulator's answers beside it, one file per
contract (`answers.json`: `answers-vllm.json`, `answers-sglang-pd.json`, ...; the
transcript's format) to read beside the recorded ones.
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
from tests.contract.calls import MAX_MODEL_LEN, MODEL, PREFILL, VOCAB_SIZE, WORKER, Contract
from tests.contract.compare import differences, features
from tests.contract.contracts import CONTRACTS
from tests.contract.runner import run_all

TRANSCRIPTS = Path(__file__).parent / "transcripts"
# The simulator's load-record heartbeat here (the real servicer's: 1 s): short, but long
# enough beside the record of a call's completion (~100 ms after it) to tell them apart.
UNIT_S = 0.5
TREE = os.environ.get("GATEWAY_CONTRACT_SIM_TREE")
DUMP = os.environ.get("GATEWAY_CONTRACT_DUMP")  # a file: the simulator's answers, as JSON


def wanted(contract: Contract, leg: str) -> tuple[tuple[str, ...], ...]:
    """The simulator's flags for the recorded worker of `leg`, each given where the
    simulator has it."""
    flags: tuple[tuple[str, ...], ...] = (
        ("--runtime", contract.engine),
        ("--model", MODEL),
        ("--max-model-len", str(MAX_MODEL_LEN)),
        ("--vocab-size", str(VOCAB_SIZE)),
        ("--block-size", str(contract.block_size)),
    )
    if leg != WORKER:
        flags += (("--role", leg),)
    if leg == PREFILL:
        # where the decode meets it: SGLang's bootstrap port, vLLM's KV side channel
        port_flag = "--bootstrap-port" if contract.engine == "sglang" else "--kv-port"
        flags += ((port_flag, "0"),)
    if contract.engine == "sglang":
        # No KV events (the recorded SGLang workers are started without them), and the
        # KV pool's size in pages of one token.
        kv_tokens = str(recorded_kv_tokens(contract.name, leg))
        return (*flags, ("--kv-blocks", kv_tokens), ("--no-kv-events",))
    if contract.kv is None:
        return flags
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


def sim_flags(contract: Contract, leg: str) -> list[str]:
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
    return [word for flag in wanted(contract, leg) if flag[0] in known for word in flag]


class Simulator:
    """A `gateway sim` process that can be killed and started again on its port."""

    def __init__(self, contract: Contract, leg: str) -> None:
        self.flags = sim_flags(contract, leg)
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


def case(contract_name: str, *rest: str) -> Any:
    """A case of a contract, in the xdist group of that contract."""
    group = pytest.mark.xdist_group(f"tests/contract/test_transcripts.py::{contract_name}")
    return pytest.param(contract_name, *rest, id="-".join((contract_name, *rest)), marks=group)


@functools.cache
def transcript(contract_name: str) -> dict[str, Any]:
    return dict(json.loads((TRANSCRIPTS / CONTRACTS[contract_name].transcript).read_text()))


def recorded(contract_name: str) -> dict[str, Any]:
    return dict(transcript(contract_name)["calls"])


def recorded_kv_tokens(name: str, leg: str) -> int:
    """The recorded worker's KV pool, in tokens (SGLang's --max-total-tokens)."""
    recorded = transcript(name)
    worker = recorded["worker"] if leg == WORKER else recorded["workers"][leg]
    args: list[str] = worker["args"]
    return int(args[args.index("--max-total-tokens") + 1])


def simulate(contract: Contract) -> dict[str, Any]:
    """The simulator's answers to the contract's calls, a simulator per worker of the
    contract (one, or a prefill and a decode); they are gone after."""
    simulators: dict[str, Simulator] = {}
    try:
        for leg in contract.legs:
            simulators[leg] = Simulator(contract, leg)
        addresses = {leg: simulator.address for leg, simulator in simulators.items()}
        restart = simulators[WORKER].restart if WORKER in simulators else None
        answers = asyncio.run(run_all(addresses, contract, restart, UNIT_S))
    finally:
        for simulator in simulators.values():
            simulator.stop()
    if DUMP:
        dump = Path(DUMP)  # one file per contract: FILE's stem, then the contract's name
        dump = dump.with_name(f"{dump.stem}-{contract.name}{dump.suffix}")
        flags = {leg: simulator.flags for leg, simulator in simulators.items()}
        dump.write_text(json.dumps({"sim_flags": flags, "calls": answers}, indent=1))
    return answers


@pytest.fixture(scope="module")
def simulated() -> Callable[[str], dict[str, Any]]:
    """Each contract's answers, its simulators run once, on first use: a fixture
    parametrized by contract would be set up again whenever the contract of the next test
    changed (pytest keeps one parameter's instance at a time)."""
    return functools.cache(lambda contract_name: simulate(CONTRACTS[contract_name]))


@pytest.mark.parametrize("contract_name", [case(name) for name in CONTRACTS])
def test_the_transcript_has_every_call(contract_name: str) -> None:
    assert sorted(recorded(contract_name)) == sorted(CONTRACTS[contract_name].names)


@pytest.mark.parametrize(
    ("contract_name", "call"),
    [case(name, call) for name, contract in CONTRACTS.items() for call in contract.names],
)
def test_the_simulator_answers_as_the_real_worker(
    contract_name: str, call: str, simulated: Callable[[str], dict[str, Any]]
) -> None:
    contract = CONTRACTS[contract_name]
    found = differences(
        features(contract, call, recorded(contract_name)[call]),
        features(contract, call, simulated(contract_name)[call]),
    )
    version = contract.transcript.removesuffix(".json")
    assert not found, f"{call}: the simulator differs from {version}:\n" + "\n".join(found)
