"""Shared fixtures: real processes on 127.0.0.1, stopped after every test (simulated
workers hosted, see `sim` below); and how the tests share a machine when pytest-xdist runs
them side by side (see `serial` below)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway_sim.launch import SERVE_ARGS, START_S, Child, start, start_sim, stop_child
from gateway_sim.redis_server import RedisServer
from tests.support import serial
from tests.support.launch import HostedSim, Launcher, SimHost

# --------------------------------------------------------------------------- xdist
#
# `make test` runs the tests in three pytest-xdist workers (pyproject.toml's addopts): most
# tests spend their time waiting on other processes and timers, and a 2-core machine can
# run three such tests at once. Some cannot share the machine: they measure something
# another test's load would distort (a latency, a memory peak, a timing window a fraction
# of a second wide), or are heavy enough to distort another's. Such a test runs alone
# from the start of its function (`@pytest.mark.serial`: its fixtures' setup need not),
# or from the point where its processes are up and its measurement begins (it calls
# `run_alone()` there), to its end.
#
# How: every test holds the run lock from its setup to its teardown (module fixtures it
# starts or stops included), shared; `run_alone()` trades that for an exclusive hold. A
# turnstile in front of the lock makes a waiting exclusive hold go next instead of
# waiting for a gap between the other workers' tests. Without xdist (`-n 0`) nothing is
# locked and `run_alone()` does nothing.
#
# Tests that share a module-scoped fixture (processes started once for a module) are
# kept on one worker (`--dist loadgroup`), so that the processes start once.

SERIAL_MARKER = (
    "serial: the test function runs alone, never beside another test (pytest-xdist): it "
    "measures a latency, a memory peak or a tight timing window, or loads the machine "
    "enough to distort another test's (see run_alone() in tests/support/serial.py)"
)

# --------------------------------------------------------------------------- timing tier
#
# `make test` must pass on a machine busy with other work (a 2-core box running two
# CPU-bound jobs beside the suite). There a timer fires late and a process takes seconds
# to start, so a test proves its point by states (it waits for what it expects, a
# generous timeout only as a safety net), by counts, or by ratios to a baseline it
# measures itself. The strict wall-clock bounds the gateway also promises (a latency
# within 100 ms, a timeout kept to within a few tenths of a second) hold on an idle
# machine only: such a check is marked `timing`, which `make test` leaves out
# (pyproject's addopts) and `make test-timing` runs, one test at a time. A test that
# holds both takes the `strict` fixture: it runs twice, strict False in `make test`,
# strict True (marked `timing`) in the timing tier.

TIMING_MARKER = (
    "timing: strict wall-clock bounds that hold on an idle machine only (a latency, how "
    "late a timer fires); left out of `make test`, run by `make test-timing`"
)


@pytest.fixture(
    params=[
        pytest.param(False, id="state"),
        pytest.param(True, id="timing", marks=pytest.mark.timing),
    ]
)
def strict(request: pytest.FixtureRequest) -> bool:
    """Whether this run of the test also asserts its strict wall-clock bounds (the timing
    tier); without them it proves the same by states and ratios."""
    return bool(request.param)


LOCK_DIR = pytest.StashKey[str]()  # where the run lock's files are (tests/support/serial.py)


# --------------------------------------------------------------------------- bytecode
#
# Where PYTHONDONTWRITEBYTECODE is set (in many container images, and on the machine
# these tests were tuned on), every gateway and simulator process a test starts (hundreds
# a run) compiles the gateway's and the simulator's sources again: some 0.05 s of CPU
# each, a tenth of a simulator's start. The processes of a run share one bytecode cache
# instead, in a directory of the run (PYTHONPYCACHEPREFIX): the source tree gets nothing.

PYCACHE_DIR = pytest.StashKey[str]()


def _share_bytecode(config: pytest.Config) -> None:
    """In the process that starts the others (xdist's workers inherit it), before any."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in os.environ:
        config.stash[PYCACHE_DIR] = tempfile.mkdtemp(prefix="pytest-pycache-")
        os.environ["PYTHONPYCACHEPREFIX"] = config.stash[PYCACHE_DIR]
        del os.environ["PYTHONDONTWRITEBYTECODE"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SERIAL_MARKER)
    config.addinivalue_line("markers", TIMING_MARKER)
    config.addinivalue_line("markers", SIM_PROCESSES_MARKER)
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker
        if "run_lock_dir" in workerinput:
            serial.install(serial.RunLock(Path(workerinput["run_lock_dir"])))
        return
    _share_bytecode(config)
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        config.stash[LOCK_DIR] = tempfile.mkdtemp(prefix="pytest-run-lock-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, in the controller, for each worker it starts: where the run lock is."""
    directory = node.config.stash.get(LOCK_DIR, None)
    if directory is not None:
        node.workerinput["run_lock_dir"] = directory


def pytest_unconfigure(config: pytest.Config) -> None:
    lock = serial.current()
    if lock is not None:
        lock.close()
        serial.install(None)
    for key in (LOCK_DIR, PYCACHE_DIR):
        if key in config.stash:
            shutil.rmtree(config.stash[key], ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    lock = serial.current()
    if lock is None:
        return (yield)
    lock.acquire(exclusive=False)
    try:
        return (yield)
    finally:
        lock.release()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    if item.get_closest_marker("serial") is not None:
        serial.run_alone()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use a module-scoped fixture of this suite go to one xdist worker, in a
    group per module (`--dist loadgroup`), so the fixture's processes start once."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        if any(
            defs
            and defs[-1].scope in ("module", "class", "package")
            and str(defs[-1].baseid).startswith("tests")
            for defs in info.name2fixturedefs.values()
        ):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def processes() -> Iterator[list[Child]]:
    """Every child a test starts; all of them are stopped when the test ends."""
    children: list[Child] = []
    yield children
    for child in reversed(children):
        stop_child(child)


# --------------------------------------------------------------------------- workers
#
# A simulated worker is a test double, and starting a Python process for each costs a
# third of a second of CPU (hundreds a run). So `sim` starts them as servers in one
# process per test process, shared by its tests (tests/e2e/simhost.py): the same
# `gateway_sim` server, ports and protocol, started and stopped in milliseconds. A test
# that needs a worker to be a process of its own (a signal, SIGKILL, SIGSTOP,
# `x-sim-exit-after`, a worker busy enough to need a core, a latency measured) is marked
# `sim_processes`, and `sim` starts `gateway sim` processes for it.

SIM_PROCESSES_MARKER = (
    "sim_processes: the `sim` fixture starts each simulated worker as a process of its "
    "own (signals, SIGKILL, SIGSTOP, x-sim-exit-after, a core of its own)"
)


@pytest.fixture(scope="session")
def sim_host() -> Iterator[SimHost]:
    host = SimHost()
    yield host
    host.close()


@pytest.fixture
def sim(
    request: pytest.FixtureRequest, processes: list[Child], sim_host: SimHost
) -> Iterator[Launcher]:
    """`sim("--runtime", "vllm", "--model", "m")` starts a simulated worker: hosted, or
    a `gateway sim` process in a test marked `sim_processes`."""
    if request.node.get_closest_marker("sim_processes") is not None:

        def launch(*args: str) -> Child:
            child = start_sim(*args, timeout=START_S)
            processes.append(child)
            return child

        yield launch
        return
    hosted: list[HostedSim] = []

    def host(*args: str) -> Any:
        worker = sim_host.start(*args)
        hosted.append(worker)
        return worker

    yield host
    for worker in hosted:
        worker.stop()


@pytest.fixture
def gateway(processes: list[Child], tmp_path_factory: pytest.TempPathFactory) -> Launcher:
    """`gateway("--worker", url, ...)` starts `gateway serve` on a free port.

    Its log (JSON lines) goes to `child.log_path` so tests can read request events.
    """

    def launch(*args: str) -> Child:
        log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
        log_file = open(log_path, "w")  # noqa: SIM115 - the child owns it for its lifetime
        child = start([*SERVE_ARGS, *args], stderr=log_file.fileno(), timeout=START_S)
        log_file.close()
        child.log_path = log_path
        processes.append(child)
        return child

    return launch


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real store (redis-server on a loopback port, in memory) for the shared-state
    tests; `stop()` then `start()` brings it back empty on the same port."""
    with RedisServer() as server:
        yield server
