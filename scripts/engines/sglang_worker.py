"""One real SGLang gRPC worker on the CPU, as a child process on 127.0.0.1, for the
real-engine tests (tests/engines) and the transcript recorder.

    with SglangWorker(".venv-engines/bin/python", ".engines/model") as worker:
        worker.start()   # bounded wait until grpc.health says SERVING on SglangScheduler
        worker.kill()    # SIGKILL of its whole process group; start() again: same ports

SGLang (PyPI `sglang` ADDONS_VERSION) runs under the engines venv's python with its
add-ons beside it, never in it: `.engines/sglang-addons` (sglang itself and the few
pure-Python packages it imports that the venv lacks, installed `--no-deps` by
`make engines-sglang`) and the stand-ins of scripts/engines/standins (sgl_kernel,
torchvision, IPython, which cannot run beside torch's CPU build), on its PYTHONPATH
only. Flags: SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1 --device cpu`), the
torch_native attention backend, no CUDA graphs, no server warm-up, float32, a scheduler
that sleeps while idle (`--sleep-on-idle`: without it, each scheduler spins a whole core
when it has nothing to do, measured 87-101% of a core, 1.4-2% with it), and a KV pool of
`kv_tokens` (its default takes most of the machine's memory). Its HTTP sidecar
listens on the gRPC port + 1 (`--smg-http-sidecar-port`), so `port` is chosen with a free
neighbour. The process group, guard, start, stop and kill are EngineWorker's.

`disaggregation` ("prefill" or "decode") makes it a PD leg over Mooncake on TCP
(`--disaggregation-transfer-backend mooncake`, MOONCAKE_PROTOCOL=tcp, every address
127.0.0.1): PyPI `mooncake-transfer-engine-non-cuda` from `.engines/mooncake-addons`
(`make engines-mooncake`) and the load-time patch of scripts/engines/patches on its
PYTHONPATH. A prefill's bootstrap port is a free port of its own, kept across restarts;
a decode keeps what a retraction preempts in plain CPU tensors
(`--disaggregation-decode-retraction-backup cpu_tensor`: the default, a host pool, pins
its memory with cudaHostRegister, which needs CUDA). A prefill does not send a cached
prefix ahead of the rest (SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=false): that
early send records a CUDA event, and the scheduler died at the first prompt whose prefix
it had cached.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from scripts.engines.ports import free_port
from scripts.engines.worker import BASE_ENV, PATCHES, WARMUP_ENV, EngineWorker

ROOT = Path(__file__).resolve().parents[2]
ADDONS = ROOT / ".engines" / "sglang-addons"
STANDINS = Path(__file__).resolve().parent / "standins"
MOONCAKE_ADDONS = ROOT / ".engines" / "mooncake-addons"
ADDONS_VERSION = "0.5.23"
DISAGGREGATION_MODES = ("prefill", "decode")
SGLANG_SERVICE = "sglang.grpc.scheduler.SglangScheduler"
KV_TOKENS = 65_536  # 128 MB of float32 KV for the tiny model: room for the tests' calls
MAX_PORT = 65535 - 10_000  # see free_port_pair


def free_port_pair() -> int:
    """A free port whose next one is free too (gRPC, then the HTTP sidecar), at most
    MAX_PORT: SGLang 0.5.23's --grpc-mode derives a port of +10000 and refuses to start
    when that passes 65535 (`--grpc-port / SGLANG_GRPC_PORT (68143) must be between 1
    and 65535`); free_port's are below the kernel's ephemeral range, so below it."""
    port = free_port(neighbours=1)
    if port > MAX_PORT:
        raise RuntimeError(f"port {port} is above {MAX_PORT}")
    return port


class SglangWorker(EngineWorker):
    """A real SGLang gRPC worker (smg-grpc-servicer's SglangScheduler)."""

    engine = "SGLang"
    engine_service = SGLANG_SERVICE

    def __init__(
        self,
        python: str | os.PathLike[str],
        model: str | os.PathLike[str],
        *,
        name: str = "tiny",
        port: int | None = None,
        kv_tokens: int = KV_TOKENS,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        addons: str | os.PathLike[str] = ADDONS,
        disaggregation: str | None = None,
    ) -> None:
        if disaggregation is not None and disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation must be one of {DISAGGREGATION_MODES}, not {disaggregation!r}"
            )
        port = port or free_port_pair()
        if port > MAX_PORT:
            raise ValueError(f"SGLang's --grpc-mode needs a port of at most {MAX_PORT}")
        super().__init__(
            python,
            model,
            name=name,
            port=port,
            warmup=None,
            extra_args=extra_args,
            env=env,
            workdir=workdir,
        )
        self.kv_tokens = kv_tokens
        self.addons = Path(addons)
        self.disaggregation = disaggregation
        self.bootstrap_port = free_port() if disaggregation == "prefill" else None

    def args(self) -> list[str]:
        return [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model,
            "--served-model-name",
            self.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--grpc-mode",
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-cuda-graph",
            "--skip-server-warmup",
            "--sleep-on-idle",
            "--dtype",
            "float32",
            "--max-total-tokens",
            str(self.kv_tokens),
            *self.disaggregation_args(),
            *self.extra_args,
        ]

    def disaggregation_args(self) -> list[str]:
        """A PD leg's flags: its mode over Mooncake; a prefill's bootstrap port, a
        decode's retraction backup in CPU tensors."""
        if self.disaggregation is None:
            return []
        args = ["--disaggregation-mode", self.disaggregation]
        args += ["--disaggregation-transfer-backend", "mooncake"]
        if self.bootstrap_port is not None:
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        else:
            args += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        return args

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **BASE_ENV, "SGLANG_USE_CPU_ENGINE": "1"}
        env.pop(WARMUP_ENV, None)
        paths = [self.addons, STANDINS]
        if self.disaggregation is not None:
            paths += [MOONCAKE_ADDONS, PATCHES]
            env.update({"MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1"})
            env["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] = "false"
        env["PYTHONPATH"] = os.pathsep.join(str(path) for path in paths)
        env.update(self.extra_env)
        return env
