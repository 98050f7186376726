"""One real vLLM gRPC worker as a child process, on 127.0.0.1, for the real-engine tests
(tests/engines) and the transcript recorder (tests/contract/record.py).

    with EngineWorker(python=".venv-engines/bin/python", model=".engines/model") as worker:
        worker.start()            # bounded wait until grpc.health says SERVING
        ...                       # worker.address, worker.kv_endpoint
        worker.kill()             # SIGKILL, the whole process group (a crash)
        worker.start()            # the same port and KV events endpoint again

The worker runs vLLM's own gRPC launcher (`python -m vllm.entrypoints.launchers.grpc_server`,
which serves smg-grpc-servicer's VllmEngine) under the engines venv's python, in a
process group of its own: vLLM starts an engine-core and a model-runner process, and
every stop (stop, kill, the context manager's exit, an error while starting) ends the
whole group. A small guard leads the group (GUARD): it ends the group when the launcher
exits and when the process that started the worker dies, however it died. The KV events
publisher listens on an `ipc://` socket in the worker's own temporary directory, so
nothing listens beyond loopback (the servicer would otherwise turn the publisher on by
itself, on every interface). This module runs under the main venv (grpcio,
grpcio-health-checking); only the worker process needs the engines venv.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scripts.engines.ports import free_port

LAUNCHER = "vllm.entrypoints.launchers.grpc_server"
ENGINE_SERVICE = "vllm.grpc.engine.VllmEngine"
START_TIMEOUT_S = 420.0  # seen: 60-215 s on a 2-core machine, more beside other work
STOP_TIMEOUT_S = 20.0
POLL_S = 0.5
# vLLM on CPU: 1 GiB of KV cache, no thread pinning (the tests share two cores), nothing
# fetched from a hub (the model is a local directory), no usage reports.
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
WARMUP_ENV = "SMG_VLLM_SERVICER_WARMUP"  # the servicer's planned warm-up: on unless "off"
ROOT = Path(__file__).resolve().parents[2]
# vLLM PD: PyPI nixl + nixl-cu12 beside the engines venv (make engines-nixl), and the
# load-time patch of NIXL's progress thread (scripts/engines/patches/sitecustomize.py).
NIXL_ADDONS = ROOT / ".engines" / "nixl-addons"
PATCHES = Path(__file__).resolve().parent / "patches"
KV_ROLES = ("kv_producer", "kv_consumer")  # a prefill, a decode


# The worker's process group leader, between this process and vLLM's launcher: it runs
# the launcher, passes it SIGTERM, and ends the whole group (the launcher's engine-core
# and model-runner processes, which outlive a launcher that was killed) once the launcher
# has exited or once whoever started the worker is gone, whatever way it went (a test
# run killed with SIGKILL included).
GUARD = """
import os, signal, subprocess, sys, time
parent = os.getppid()
launcher = subprocess.Popen(sys.argv[1:])
def forward(signum, frame):
    if launcher.poll() is None:
        launcher.send_signal(signum)
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
while launcher.poll() is None and os.getppid() == parent:
    time.sleep(0.25)
why = "its starter is gone" if os.getppid() != parent else f"exit {launcher.poll()}"
print(f"==== worker guard: launcher ended ({why}): ending its process group", flush=True)
os.killpg(0, signal.SIGKILL)
"""


class WorkerFailed(RuntimeError):
    """The worker exited, or did not serve, within its start-up bound."""


def health_status(address: str, service: str = "", timeout: float = 2.0) -> int | None:
    """grpc.health Check's status, None when the worker does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return None
    return int(reply.status)


def group_alive(pgid: int) -> bool:
    """Whether a process of this process group is still running (not a zombie)."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: a zombie counts as alive
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class EngineWorker:
    """A real vLLM gRPC worker: start, stop, kill -9 and start again on the same port and
    KV events endpoint. Not thread-safe; one owner. Another engine's worker overrides
    `args` and `environment` (scripts/engines/sglang_worker.py)."""

    engine = "vLLM"  # as messages name it
    engine_service = ENGINE_SERVICE  # whose grpc.health SERVING means it serves

    def __init__(
        self,
        python: str | os.PathLike[str],
        model: str | os.PathLike[str],
        *,
        name: str = "tiny",
        port: int | None = None,
        max_model_len: int = 2048,
        warmup: str | None = "off",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        kv_role: str | None = None,
    ) -> None:
        """`warmup`: the servicer's SMG_VLLM_SERVICER_WARMUP ("off" by default here: it
        saves some 25 s a start; None leaves the servicer's default, a full warm-up).
        `workdir`: where the KV events socket and the log go (a new temporary directory
        by default, removed by close()). `kv_role`: a PD leg over NIXL in host memory
        (`kv_producer`: a prefill, `kv_consumer`: a decode), its NIXL side channel on
        127.0.0.1 and a port of its own, kept across restarts."""
        if kv_role is not None and kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, not {kv_role!r}")
        self.kv_role = kv_role
        self.side_channel_port = free_port() if kv_role is not None else None
        self.python = str(python)
        self.model = str(Path(model).resolve())
        self.name = name
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.warmup = warmup
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(env or {})
        self._own_workdir = workdir is None
        # Short: a unix socket path has at most 107 bytes.
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="vw-", dir="/tmp"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "worker.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start_seconds: list[float] = []  # how long each start took, until SERVING

    # ------------------------------------------------------------------ what it runs

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The worker's URL for `gateway serve --worker`, model and runtime left out."""
        return f"grpc://{self.address}"

    @property
    def kv_endpoint(self) -> str:
        return f"ipc://{self.workdir / 'kv-events'}"

    def kv_events_config(self) -> str:
        return json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.kv_endpoint}
        )

    def args(self) -> list[str]:
        return [
            self.python,
            "-m",
            LAUNCHER,
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.name,
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--kv-events-config",
            self.kv_events_config(),
            *self.kv_transfer_args(),
            *self.extra_args,
        ]

    def kv_transfer_args(self) -> list[str]:
        """A PD leg's connector: NIXL, its KV buffers in host memory."""
        if self.kv_role is None:
            return []
        config = {"kv_connector": "NixlConnector", "kv_role": self.kv_role}
        return ["--kv-transfer-config", json.dumps({**config, "kv_buffer_device": "cpu"})]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **BASE_ENV}
        env.pop(WARMUP_ENV, None)
        if self.warmup is not None:
            env[WARMUP_ENV] = self.warmup
        if self.kv_role is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(NIXL_ADDONS), str(PATCHES)])
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------ lifecycle

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = START_TIMEOUT_S) -> float:
        """Start the worker and wait (bounded) until grpc.health says SERVING for the
        engine service; returns the seconds it took. Whatever goes wrong, nothing is left
        running."""
        if self.running:
            raise RuntimeError(f"worker {self.address} is running already")
        self.starts += 1
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== start {self.starts}: {' '.join(self.args())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [self.python, "-c", GUARD, *self.args()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self.workdir,
                start_new_session=True,  # its own process group, which the guard leads
            )
        try:
            self._wait_serving(began + timeout)
        except BaseException:
            self.kill()
            raise
        took = time.monotonic() - began
        self.start_seconds.append(took)
        return took

    def _wait_serving(self, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise WorkerFailed(
                    f"{self.engine} worker {self.address} exited with "
                    f"{self.process.returncode} while starting; last lines of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if (
                health_status(self.address, self.engine_service)
                == health_pb2.HealthCheckResponse.SERVING
            ):
                return
            time.sleep(POLL_S)
        raise WorkerFailed(
            f"{self.engine} worker {self.address} did not serve within its bound; last lines of "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def _signal_group(self, signum: int) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (a crash) and reap it."""
        if self.process is None:
            return
        self._signal_group(signal.SIGKILL)
        self.process.wait()
        self._reap_group()
        self.process = None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the launcher (vLLM shuts its engine down), SIGKILL to the whole group
        if it has not ended after `timeout`; either way, every process of the group is
        gone when this returns."""
        if self.process is None:
            return
        process = self.process
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)  # the guard passes it to the launcher
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                process.wait()
        self._reap_group()
        self.process = None

    def _reap_group(self) -> None:
        """The guard has exited: the rest of its group may still be ending for a moment.
        Waits (bounded) until every member has exited (zombies waiting for init to reap
        them hold nothing)."""
        assert self.process is not None
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while group_alive(self.process.pid) and time.monotonic() < deadline:
            self._signal_group(signal.SIGKILL)
            time.sleep(0.05)

    def restart(self, timeout: float = START_TIMEOUT_S) -> float:
        """kill -9 and start again: the same port, model and KV events endpoint."""
        self.kill()
        return self.start(timeout)

    def close(self) -> None:
        """Stop the worker; remove its directory if this object made it."""
        try:
            self.stop()
        finally:
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> EngineWorker:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
