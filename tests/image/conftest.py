"""The container image tier: the image `make image` builds, run the way the Kubernetes
Deployment runs it (deploy/kubernetes/deployment.yaml): its own USER (UID/GID 10001), a
read-only root filesystem with only /tmp writable, no capabilities, no privilege
escalation, the config mounted read-only at /etc/gateway. podman runs it on the project's
image store (scripts/image/store.sh), on the host's network: the gateway inside and the
simulated worker the test starts on the host meet on 127.0.0.1.

`make test-image` builds the image, installs podman and runc if missing, and runs
`pytest -n 0 tests/image` with GATEWAY_IMAGE set to the image's name. Without it, nothing
here is collected: `make test` does not see these tests at all.

Every container a test starts is removed when the test ends, whatever happened (`podman
rm --force`), and the `podman run` process that attached to it is reaped.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway_sim.launch import START_S, Child, NotReady, ready
from tests.support.launch import STOP_S

IMAGE = os.environ.get("GATEWAY_IMAGE", "")
ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "scripts" / "image" / "store.sh"
CONFIG_DIR = "/etc/gateway"  # where the Deployment mounts its ConfigMap
# podman's default open-file and process limits for a container are above what root
# may grant on this kind of machine (no CAP_SYS_RESOURCE), and runc then refuses to start
# it: the container gets this process's open-file limit and a process limit well within
# the machine's (the gateway runs some tens of threads per process).
NPROC = 4096
_names = (f"gateway-image-test-{os.getpid()}-{n}" for n in itertools.count())

if not IMAGE:
    collect_ignore_glob = ["test_*.py"]


def podman(*args: str, timeout: float = STOP_S) -> subprocess.CompletedProcess[str]:
    """podman on the project's image store; the caller checks the outcome."""
    return subprocess.run(
        [str(STORE), "podman", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def inspect_image(image: str) -> dict[str, Any]:
    """The image's metadata (`podman image inspect`): Config, Labels, Size, ..."""
    done = podman("image", "inspect", image)
    assert done.returncode == 0, done.stderr
    found: list[dict[str, Any]] = json.loads(done.stdout)
    assert len(found) == 1
    return found[0]


@dataclass
class Container:
    """A gateway running in the image: its container and the `podman run` process attached
    to it, which relays the gateway's stdout (the READY line) and ends with its exit code."""

    name: str
    child: Child

    @property
    def address(self) -> str:
        return self.child.address

    def host_pid(self) -> int:
        """The container's first process (the gateway), as the host numbers it."""
        done = podman("inspect", "--format", "{{.State.Pid}}", self.name)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    def proc(self, name: str) -> str:
        """/proc/PID/NAME of the gateway's process, read on the host (status, cmdline)."""
        return Path(f"/proc/{self.host_pid()}/{name}").read_text()

    def exec(self, *command: str) -> subprocess.CompletedProcess[str]:
        """A command inside the running container, as its user."""
        return podman("exec", self.name, *command)

    def stop(self) -> int:
        """SIGTERM to the gateway (what the kubelet sends), then its exit code."""
        podman("stop", "--time", str(int(STOP_S)), self.name, timeout=STOP_S * 2)
        return self.child.process.wait(STOP_S)

    def remove(self) -> None:
        """Gone, whatever its state, and the attached `podman run` reaped."""
        podman("rm", "--force", "--ignore", "--time", "0", self.name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.child.process.wait(STOP_S)
        self.child.kill()


def run_args(name: str, config_dir: Path) -> list[str]:
    """`podman run` as the Deployment runs the pod: the image's entrypoint, command and
    user, nothing writable but /tmp (the Deployment's emptyDir, 64 MiB)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return [
        "run",
        "--rm",
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        "--read-only-tmpfs=false",  # podman's own writable /run and /var/tmp: not in a pod
        "--tmpfs",
        "/tmp:rw,size=64m,mode=1777",
        "--volume",
        f"{config_dir}:{CONFIG_DIR}:ro",
        "--cap-drop",
        "all",
        "--security-opt",
        "no-new-privileges",
        "--ulimit",
        f"nofile={soft}:{hard}",
        "--ulimit",
        f"nproc={NPROC}:{NPROC}",
        IMAGE,
    ]


ImageLauncher = Callable[[dict[str, Any]], Container]


@pytest.fixture
def image_gateway(tmp_path: Path) -> Iterator[ImageLauncher]:
    """`image_gateway(config)` runs the image with `config` as its
    /etc/gateway/config.yaml and waits (bounded) for the gateway's READY line; every
    container it started is removed when the test ends."""
    started: list[Container] = []

    def launch(config: dict[str, Any]) -> Container:
        name = next(_names)
        config_dir = tmp_path / name
        config_dir.mkdir()
        (config_dir / "config.yaml").write_text(yaml.safe_dump(config))
        config_dir.chmod(0o755)  # the container's user reads it: not root's 0700
        (config_dir / "config.yaml").chmod(0o644)
        args = run_args(name, config_dir)
        with open(tmp_path / f"{name}.log", "w") as log:  # podman's and the gateway's stderr
            process = subprocess.Popen(
                [str(STORE), "podman", *args],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        # Removed at the end even if it never became ready (ready() kills the attached
        # `podman run`, not the container).
        container = Container(name, Child(process, 0, tuple(args)))
        started.append(container)
        try:
            container.child = ready(process, args, timeout=START_S)
        except NotReady as error:
            log_text = (tmp_path / f"{name}.log").read_text()
            raise NotReady(f"{error}\n{log_text}") from error
        return container

    yield launch
    for container in reversed(started):
        container.remove()
