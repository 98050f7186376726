"""`gateway serve` starts lean and quiet: a Ctrl-C at any instant of its start-up ends it
without a traceback, `serve`, `--version` and `--help` import no simulator, demo or admin
client, and `gateway sim` / `gateway demo` say in one line when the simulator is not
installed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway_sim.launch import START_S, ready
from tests.support.launch import STOP_S

SERVE = (
    "serve",
    "--listen",
    "127.0.0.1:0",
    "--admin-listen",
    "127.0.0.1:0",
    "--metrics-listen",
    "off",
    "--drain-delay",
    "0",
    "--log-level",
    "warning",
)
DEMO = (
    "demo",
    "--listen",
    "127.0.0.1:0",
    "--admin-listen",
    "127.0.0.1:0",
    "--metrics-listen",
    "off",
    "--log-level",
    "warning",
)
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _guarded(pid: int) -> bool:
    """Whether the process catches SIGTERM (`SigCgt` in /proc/PID/status): the gateway's
    first act; Python itself never catches SIGTERM."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & SIGTERM_BIT)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("after_s", [0.0, 0.05, 0.1, 0.2, 0.3, 0.5])
def test_ctrl_c_at_any_instant_of_start_up_exits_quietly(after_s: float) -> None:
    """SIGINT `after_s` after the spawn: importing, parsing, binding, or already serving.

    The interpreter's own start-up (before any code of the gateway runs, some 30 ms) is
    Python's, not the gateway's to guard: each instant counts from the spawn but never
    comes before the process has its quiet handlers in place (0.0: the very instant it
    does). Then: exit 130 (stopped while starting) or 0 (the server had taken over its
    signals and stopped, or drained), nothing on stdout but maybe the READY line, and
    nothing on stderr (warnings and errors only are logged) but, once serving, the
    warning that no worker is configured."""
    spawned = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", *SERVE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = spawned + START_S
        while not _guarded(process.pid):  # bounded: START_S, or the process ended
            assert process.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.001)
        time.sleep(max(0.0, spawned + after_s - time.monotonic()))
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=START_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    # Serving with no worker is worth its one warning (said once READY is near).
    said = [line for line in stderr.splitlines() if "no_usable_workers" not in line]
    assert said == [], stderr
    assert process.returncode in (0, 130), process.returncode
    assert stdout == "" or stdout.startswith("READY "), stdout


def _imported(stderr: str) -> set[str]:
    """Module names from `-X importtime` lines (`import time: self | cumulative | name`)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }


def _unwanted(modules: set[str]) -> set[str]:
    """The simulator (gateway_sim, or the old gateway.sim), the demo, the admin client."""
    return {
        name
        for name in modules
        if name in ("gateway_sim", "gateway.sim", "gateway.demo", "gateway.admin.client")
        or name.startswith(("gateway_sim.", "gateway.sim."))
    }


@pytest.mark.parametrize("argv", [["serve", "--help"], ["--version"]])
def test_serve_help_and_version_import_no_simulator_demo_or_admin_client(
    argv: list[str],
) -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gateway", *argv],
        capture_output=True,
        text=True,
        timeout=START_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    modules = _imported(result.stderr)
    assert {"gateway.cli.main", "gateway.config"} <= modules  # the parsing really was measured
    assert _unwanted(modules) == set()


def test_serve_imports_no_simulator_demo_or_admin_client(tmp_path: Path) -> None:
    """A real `gateway serve`, up to its READY line and stopped: the server side of the
    admin API, never its client, nor the simulator or the demo."""
    log = tmp_path / "stderr"
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "gateway", *SERVE],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    gw = ready(process, SERVE, START_S)  # bounded; kills the process if no READY line comes
    assert gw.stop(STOP_S) == 0  # SIGTERM, drained at once; SIGKILL if it did not exit
    modules = _imported(log.read_text())
    assert {"gateway.app.server", "gateway.admin.service"} <= modules
    assert _unwanted(modules) == set()


@pytest.mark.parametrize("command", ["sim", "demo"])
def test_sim_and_demo_without_the_simulator_say_how_to_install_it(command: str) -> None:
    """`gateway_sim` is its own distribution: where it is not installed (hidden here),
    `gateway sim` and `gateway demo` exit 2 with one line saying how to install it."""
    hide = (
        "import sys; sys.modules['gateway_sim'] = None; "
        "from gateway.__main__ import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide, command, "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=START_S,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"gateway: {command}: the simulator is not installed ")
    assert "pip install -e ./sim" in line


def _marked(mark: str) -> list[int]:
    """Pids of live processes whose environment carries `GATEWAY_TEST_MARK=mark`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"GATEWAY_TEST_MARK={mark}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    ("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"]
)
def test_a_signal_while_the_demo_starts_its_workers_stops_them_all(
    sig: signal.Signals, group: bool, tmp_path: Path
) -> None:
    """Once `gateway demo` has spawned its simulated workers (they are starting): Ctrl-C
    (the whole process group, as a terminal sends it) or SIGTERM (the demo alone) stops
    it and every worker it started, quietly."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"  # unique, even across concurrent runs
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", *DEMO],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GATEWAY_TEST_MARK": mark},
        start_new_session=True,
    )
    try:
        # Once its first worker exists (it carries the mark), bounded: they are starting.
        deadline = time.monotonic() + START_S
        while not [pid for pid in _marked(mark) if pid != process.pid]:
            assert process.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.02)
        if group:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
        _, stderr = process.communicate(timeout=STOP_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        deadline = time.monotonic() + STOP_S
        while (left := _marked(mark)) and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded: a stopped worker may take a moment to exit
        for pid in left:  # stop what a broken demo left behind, so the test leaks nothing
            os.kill(pid, signal.SIGKILL)
    assert left == []
    assert "Traceback" not in stderr, stderr
    assert process.returncode in (0, 128 + sig), process.returncode
