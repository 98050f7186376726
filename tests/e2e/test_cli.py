"""The command line: config errors, help, grpcurl against `gateway serve`, `gateway demo`."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from gateway_sim.client import SGL_SERVICE, VLLM_SERVICE, closed_port, dead_worker_url
from gateway_sim.launch import START_S, Child, start
from tests.support.launch import STOP_S, Launcher, grpcurl
from tests.support.waits import WAIT_S

SERVICES = {
    SGL_SERVICE,
    VLLM_SERVICE,
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
}


def run_gateway(*args: str, timeout: float = START_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def config_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_config_errors_exit_2_with_one_clear_line(tmp_path: Path) -> None:
    """A bad configuration, from a flag and from a file: exit status 2, nothing on
    stdout, one line on stderr naming the bad value. (The processes run in parallel:
    each is a Python start-up. Every other bad value's line, through the same entry
    point in process: tests/unit/config/test_config_errors.py.)"""
    broken = config_file(tmp_path, "broken.yaml", "listen: [1, 2\n")
    cases: list[tuple[list[str], str]] = [
        (
            ["--worker", "http://127.0.0.1:5000?model=m"],
            "worker 'http://127.0.0.1:5000?model=m': scheme must be grpc:// or grpcs://",
        ),
        (
            ["--config", broken],
            f"config file '{broken}': not valid YAML at line 2, column 1: "
            "expected ',' or ']', but got '<stream end>'",
        ),
    ]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(
            pool.map(lambda case: run_gateway("serve", "--listen", "127.0.0.1:0", *case[0]), cases)
        )
    for (args, message), result in zip(cases, results, strict=True):
        assert result.returncode == 2, args
        assert result.stdout == "", args
        assert result.stderr.splitlines() == [f"gateway: config error: {message}"], args


def test_help() -> None:
    top = run_gateway("--help")
    assert top.returncode == 0
    assert top.stdout.startswith("usage: gateway ")
    assert all(verb in top.stdout for verb in ("serve", "demo", "sim"))
    serve = run_gateway("serve", "--help")
    assert serve.returncode == 0
    assert serve.stdout.startswith("usage: gateway serve ")
    for flag in ("--config", "--listen", "--worker", "--policy", "--max-attempts"):
        assert flag in serve.stdout
    assert "\nworker URL (--worker, " in serve.stdout  # its query keys, one a line
    assert "    runtime=sglang|vllm   " in serve.stdout
    assert "\nenvironment:\n  GATEWAY_ADMIN_TOKEN " in serve.stdout  # (all: tests/unit/cli)
    check = run_gateway("check-config", "--help")
    assert check.returncode == 0
    assert check.stdout.startswith("usage: gateway check-config ")
    assert "\nexit status:\n" in check.stdout


def test_grpcurl_list_describe_and_health(gateway: Launcher) -> None:
    nobody = closed_port()
    gw = gateway("--worker", dead_worker_url(nobody, model="m", runtime="sglang"))

    listed = grpcurl("-plaintext", gw.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= SERVICES

    described = grpcurl("-plaintext", gw.address, "describe", SGL_SERVICE)
    assert described.returncode == 0, described.stderr
    assert f"{SGL_SERVICE} is a service:" in described.stdout
    assert "rpc Generate ( .sglang.grpc.scheduler.GenerateRequest ) returns ( stream" in (
        described.stdout
    )
    message = grpcurl("-plaintext", gw.address, "describe", "vllm.grpc.engine.GenerateRequest")
    assert message.returncode == 0, message.stderr
    assert "vllm.grpc.engine.GenerateRequest is a message:" in message.stdout

    health = grpcurl(
        "-plaintext", "-d", '{"service":""}', gw.address, "grpc.health.v1.Health/Check"
    )
    assert health.returncode == 0, health.stderr
    assert '"status": "SERVING"' in health.stdout


def read_lines_until(child: Child, marker: str, within_s: float = WAIT_S) -> list[str]:
    """stdout lines up to and including the first one containing `marker` (bounded wait).

    The pipe is a buffered text stream (`select` cannot see what `readline` has already
    buffered), so the blocking reads run in a thread that the caller waits for, bounded.
    """
    stdout = child.process.stdout
    assert stdout is not None

    def read() -> list[str]:
        lines: list[str] = []
        for line in stdout:
            lines.append(line.rstrip("\n"))
            if marker in line:
                break
        return lines

    with ThreadPoolExecutor(max_workers=1) as pool:
        lines = pool.submit(read).result(timeout=within_s)
    assert lines and marker in lines[-1], lines
    return lines


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


def test_demo_prints_working_grpcurl_lines_and_exits_0(processes: list[Child]) -> None:
    """Every grpcurl line the demo prints works against it; SIGTERM then stops it with
    exit 0 (Ctrl-C in a terminal is the same handler). `--exit-after` is the next test's:
    a timer here would have to outlast the commands on however busy a machine."""
    demo = start(list(DEMO), stderr=subprocess.DEVNULL, timeout=START_S)
    processes.append(demo)
    lines = read_lines_until(demo, "NOT_FOUND verdict")
    printed = [shlex.split(line, comments=True) for line in lines if line.startswith("  ")]
    commands = [argv for argv in printed if Path(argv[0]).name == "grpcurl"]
    assert len(commands) == 9
    # As printed: `grpcurl` where PATH finds this environment's, else its path.
    for program in {argv[0] for argv in printed if Path(argv[0]).name in ("grpcurl", "gateway")}:
        assert shutil.which(program) is not None, program
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:  # independent calls
        replies = list(pool.map(lambda argv: grpcurl(*argv[1:], timeout=WAIT_S), commands))
    results = list(zip(commands, replies, strict=True))

    def result_for(*needles: str) -> subprocess.CompletedProcess[str]:
        [found] = [r for argv, r in results if all(n in argv for n in needles)]
        return found

    listed = result_for("list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= SERVICES
    assert "rpc Generate" in result_for("describe").stdout
    assert '"status": "SERVING"' in result_for("grpc.health.v1.Health/Check").stdout

    for model, request_id in (("deepseek-pd", "r1"), ("qwen-vl-epd", "r3")):
        disaggregated = result_for(f"x-model-id: {model}", f"{SGL_SERVICE}/Generate")
        assert disaggregated.returncode == 0, disaggregated.stderr
        assert disaggregated.stdout.count(f'"request_id": "{request_id}"') == 6
    sglang = result_for("x-model-id: llama-3-8b", f"{SGL_SERVICE}/Generate")
    assert sglang.returncode == 0, sglang.stderr
    assert sglang.stdout.count('"request_id": "r1"') == 6  # 5 tokens + complete
    assert '"finish_reason": "length"' in sglang.stdout
    vllm = result_for(f"{VLLM_SERVICE}/Generate")
    assert vllm.returncode == 0, vllm.stderr
    assert vllm.stdout.count('"chunk"') == 5
    assert '"finish_reason": "length"' in vllm.stdout
    loads = result_for(f"{SGL_SERVICE}/GetLoads")
    assert loads.returncode == 0, loads.stderr
    assert loads.stdout.count('"max_running_requests"') == 2  # one entry per SGLang worker

    not_found = result_for("x-model-id: no-such-model")
    assert not_found.returncode == 64 + grpc.StatusCode.NOT_FOUND.value[0]
    assert "Code: NotFound" in not_found.stderr
    assert "x-http-status: 404" in not_found.stdout
    assert "Model 'no-such-model' is not served by any worker" in not_found.stderr

    demo.process.send_signal(signal.SIGTERM)
    assert demo.process.wait(timeout=STOP_S) == 0


def test_demo_exit_after_stops_it_by_itself_with_0(processes: list[Child], tmp_path: Path) -> None:
    """`--exit-after S`: the demo stops on its own, S seconds after it is ready, with
    exit 0, and every worker it started is gone (it waits for them before it exits)."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"  # unique, even across concurrent runs
    demo = start(
        [*DEMO, "--exit-after", "0.2"],
        stderr=subprocess.DEVNULL,
        env={"GATEWAY_TEST_MARK": mark},
        timeout=START_S,
    )
    processes.append(demo)
    assert demo.process.wait(timeout=STOP_S) == 0
    assert marked_processes(mark) == []


def marked_processes(mark: str) -> list[int]:
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


@pytest.mark.timeout(2 * START_S + 60)
def test_demo_stops_every_worker_it_started_when_one_fails_to_start(tmp_path: Path) -> None:
    """`--token-ms nope` fails every simulated worker that takes timing flags, while the
    encoder (which takes none) starts: the demo must stop it before it exits."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"  # unique, even across concurrent runs
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "demo", "--token-ms", "nope", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=2 * START_S,  # seven processes starting at once (some 40 s when busy)
        check=False,
        env={**os.environ, "GATEWAY_TEST_MARK": mark},
    )
    left = marked_processes(mark)
    for pid in left:  # stop what a broken demo left behind, so the test leaks nothing
        os.kill(pid, signal.SIGKILL)
    assert result.returncode != 0
    assert result.stderr.startswith("gateway: demo: gateway sim --listen 127.0.0.1:0 ")
    assert "did not become ready (exit 2)" in result.stderr
    assert left == []
