"""Real-engine tests: the gateway in front of real vLLM and SGLang gRPC workers (vLLM for
CPU and SGLang's CPU engine, each with smg-grpc-servicer, serving the tiny random-weight
Llama of scripts/engines/make_model.py).

`make test-engines` runs them: it installs the engines venv (.venv-engines) and makes the
model (.engines/model) once, then runs `pytest -n 0 tests/engines` with
GATEWAY_ENGINES_PYTHON (the engines venv's python) and GATEWAY_ENGINES_MODEL (the model
directory) set. Without both, nothing here is collected: `make test` does not see these
tests at all (no pile of skips).

A worker takes half a minute or more to start and 1.5-3.5 GB of memory, so workers are
started once per session and shared: `engine` (vLLM) and `sglang` are one worker each for
every test that only sends it calls; `engines.start()` starts another (`kind="sglang"`
for SGLang; at most MAX_WORKERS at once, counting the shared ones: a test stops what it
started), for a test that kills it (`worker.kill()`, kill -9 of its process group) and
starts it again on the same port (`worker.start()`). Every worker is stopped when the
session ends, whatever happened. The gateway comes from tests/conftest.py (`gateway` fixture:
a `gateway serve` process per test, stopped after it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway_sim.launch import Child
from tests.support.launch import Launcher

ENGINES_PYTHON = os.environ.get("GATEWAY_ENGINES_PYTHON", "")
ENGINES_MODEL = os.environ.get("GATEWAY_ENGINES_MODEL", "")
MAX_WORKERS = 4  # 1.5-3.5 GB each on a 24 GB, 2-core machine
# Real engines on two shared cores stop answering for seconds under load, grpc.health
# included: a vLLM PD worker in a stalled NIXL transfer (13.9 s once), an SGLang decode on
# a machine at load 7 (probes timing out for 2 s). The default probe (1 s, two failures in
# a row: right where a servicer has a core to itself) then takes a serving worker out and
# calls meet no worker. Every gateway of the tier probes as a deployment on CPUs would.
PATIENT_PROBE = {"timeout_s": 5.0, "failure_threshold": 3}
# pytest-timeout counts fixtures' setup: a test whose worker starts with it needs minutes.
TIMEOUT_S = 900

if not (ENGINES_PYTHON and ENGINES_MODEL):
    collect_ignore_glob = ["test_*.py"]
else:
    from scripts.engines.sglang_worker import SglangWorker
    from scripts.engines.worker import EngineWorker


class Engines:
    """The session's real workers; at most MAX_WORKERS running at once."""

    def __init__(self, python: str, model: str) -> None:
        self.python = python
        self.model = model
        self.workers: list[EngineWorker] = []

    def running(self) -> int:
        return sum(1 for worker in self.workers if worker.running)

    def start(self, kind: str = "vllm", **kwargs: Any) -> EngineWorker:
        """A new worker of `kind` (vllm, sglang), started (bounded wait until it serves);
        stopped at the session's end. Keyword arguments go to EngineWorker or SglangWorker
        (name, extra_args, env, port, ...)."""
        if self.running() >= MAX_WORKERS:
            raise RuntimeError(
                f"at most {MAX_WORKERS} real workers at once: stop one first "
                "(worker.stop() or worker.kill())"
            )
        make = SglangWorker if kind == "sglang" else EngineWorker
        worker = make(self.python, self.model, **kwargs)
        self.workers.append(worker)
        worker.start()
        return worker

    @contextlib.contextmanager
    def group(self) -> Iterator[list[EngineWorker]]:
        """The workers a module starts together (append each `start` returns): all closed
        when the block ends, whatever happened, a start that failed half-way included
        (else the ones started before it count against MAX_WORKERS for the session)."""
        started: list[EngineWorker] = []
        try:
            yield started
        finally:
            for worker in reversed(started):
                worker.close()

    def close(self) -> None:
        for worker in reversed(self.workers):
            worker.close()
        self.workers.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S))


def with_patient_probe(args: Sequence[str], directory: Path) -> list[str]:
    """`gateway serve` arguments whose configuration has PATIENT_PROBE (the one given,
    copied into `directory` with it, a probe it sets itself kept; else one of its own)."""
    args = list(args)
    given = args.index("--config") + 1 if "--config" in args else None
    settings = yaml.safe_load(Path(args[given]).read_text()) if given is not None else {}
    settings["probe"] = {**PATIENT_PROBE, **(settings.get("probe") or {})}
    path = directory / "patient.yaml"
    path.write_text(yaml.safe_dump(settings))
    if given is None:
        return [*args, "--config", str(path)]
    args[given] = str(path)
    return args


@pytest.fixture
def gateway(gateway: Launcher, tmp_path_factory: pytest.TempPathFactory) -> Launcher:
    """The usual `gateway` fixture, probing patiently (PATIENT_PROBE)."""

    def launch(*args: str) -> Child:
        return gateway(*with_patient_probe(args, tmp_path_factory.mktemp("probe")))

    return launch


@pytest.fixture(scope="session")
def engines() -> Iterator[Engines]:
    model = Path(ENGINES_MODEL)
    assert (model / "config.json").is_file(), f"no model in {model}: run make test-engines"
    pool = Engines(ENGINES_PYTHON, str(model))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def engine(engines: Engines) -> EngineWorker:
    """One real worker for the session, serving model `tiny`. Tests that only send it
    calls share it; one that kills or restarts a worker starts its own
    (`engines.start()`)."""
    return engines.start(name="tiny")


@pytest.fixture(scope="session")
def sglang(engines: Engines) -> EngineWorker:
    """One real SGLang worker for the session, serving model `tiny`."""
    return engines.start("sglang", name="tiny")


@pytest.fixture(autouse=True)
def engine_alive(request: pytest.FixtureRequest) -> None:
    """A shared worker that died (a test killed it, or it crashed) is started again
    before the next test that uses it."""
    for shared in ("engine", "sglang"):
        if shared in request.fixturenames:
            worker: EngineWorker = request.getfixturevalue(shared)
            if not worker.running:
                worker.start()
