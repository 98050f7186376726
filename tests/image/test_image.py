"""The image as the Deployment runs it: its metadata agrees with the manifests and the
package, and the gateway in it serves (health, one streamed Generate through it to a
simulated SGLang worker on the host) as UID 10001 on a read-only root, with one serving
process or a supervisor of two, and drains and exits 0 on SIGTERM as PID 1."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
import yaml
from grpc_health.v1 import health_pb2

from gateway_sim.client import (
    channel,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health,
    wait_health_status,
)
from gateway_sim.launch import worker_url
from tests.image.conftest import CONFIG_DIR, IMAGE, ROOT, ImageLauncher, inspect_image
from tests.support.launch import Launcher

UID = GID = 10001  # deployment.yaml's runAsUser and runAsGroup
DEPLOY = ROOT / "deploy" / "kubernetes"
TOKENS = 5  # one message per token and the final one


def _version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def _pod_spec() -> dict[str, Any]:
    deployment = yaml.safe_load((DEPLOY / "deployment.yaml").read_text())
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def _ids(status: str, field: str) -> list[int]:
    """`Uid:` or `Gid:` of /proc/PID/status: real, effective, saved, filesystem."""
    (line,) = (line for line in status.splitlines() if line.startswith(f"{field}:"))
    return [int(word) for word in line.split()[1:]]


def test_image_metadata_agrees_with_the_deployment_and_the_package() -> None:
    image = inspect_image(IMAGE)
    config = image["Config"]
    pod = _pod_spec()
    (container,) = pod["containers"]
    assert IMAGE.rpartition(":")[2] == _version()
    # The manifests name this image, under a registry that kustomization.yaml replaces.
    repository, _, tag = container["image"].rpartition(":")
    assert (repository.rpartition("/")[2], tag) == ("grpc-model-gateway", _version())
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (override,) = kustomization["images"]
    assert override["name"] == repository
    assert override["newTag"] == _version()
    assert config["User"] == f"{UID}:{GID}"
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (UID, GID)
    # What the Deployment runs is what the image runs by itself.
    assert [*config["Entrypoint"], *config["Cmd"]] == container["command"]
    assert config["Cmd"][-1] == f"{CONFIG_DIR}/config.yaml"
    ports = {f"{port['containerPort']}/tcp" for port in container["ports"]}
    assert set(config["ExposedPorts"]) == ports
    env = dict(entry.split("=", 1) for entry in config["Env"])
    assert env["HOME"] == env["TMPDIR"] == "/tmp"  # the only writable place
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PATH"].startswith("/opt/gateway/bin:")
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == _version()
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.title"] == "grpc-model-gateway"


# 2: a supervisor and its serving processes, which keep their control sockets in TMPDIR.
@pytest.mark.parametrize("processes", [1, 2])
async def test_gateway_in_the_image_serves_read_only_as_uid_10001(
    sim: Launcher, image_gateway: ImageLauncher, processes: int
) -> None:
    worker = sim("--runtime", "sglang", "--model", "m")
    container = image_gateway(
        {
            "listen": "127.0.0.1:0",
            "processes": processes,
            "admin": {"listen": "127.0.0.1:0"},
            "metrics": {"listen": "127.0.0.1:0"},
            "drain": {"delay_s": 0, "grace_s": 5},
            "log_format": "json",
            "workers": [worker_url(worker, model="m", runtime="sglang")],
        }
    )
    await wait_health_status(container.address, "", health_pb2.HealthCheckResponse.SERVING)
    await wait_health(container.address, "m")
    async with channel(container.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(sgl_generate(tokens=TOKENS), metadata=model_md("m"))
        replies = [reply async for reply in call]
    assert len(replies) == TOKENS + 1
    assert replies[-1].complete.finish_reason == "length"

    status = container.proc("status")
    assert _ids(status, "Uid") == [UID] * 4
    assert _ids(status, "Gid") == [GID] * 4
    assert "gateway" in container.proc("cmdline")
    refused = container.exec("touch", "/probe")
    assert refused.returncode != 0
    assert "Read-only file system" in refused.stderr
    assert container.exec("touch", "/tmp/probe").returncode == 0

    assert container.stop() == 0  # SIGTERM: drained, exit 0
