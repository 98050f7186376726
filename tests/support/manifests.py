"""deploy/kubernetes read for the manifest tests (tests/architecture/test_deploy_*.py): its
YAML documents, the gateway's Deployment, container and ports, the config its ConfigMap
holds, and whether a selector matches a pod's labels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gateway.config import GatewayConfig, build_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# Schemas bundled with kubernetes-validate 1.37.0: 1.25 .. 1.37. The newest, and an
# older release still common in managed clusters.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
NAMESPACE = "model-gateway"
NOT_KUBERNETES = {"kustomization.yaml"}  # kustomize's own file, no API kind


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml") if p.name not in NOT_KUBERNETES)


def _all_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in _manifest_files():
        for doc in _documents(path):
            yield f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc


def _one(kind: str, name: str | None = None, file: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for where, doc in _all_documents()
        if doc["kind"] == kind
        and (name is None or doc["metadata"]["name"] == name)
        and (file is None or where.startswith(f"{file}:"))
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _gateway_deployment() -> dict[str, Any]:
    return _one("Deployment", "grpc-model-gateway")


def _container_port(container: dict[str, Any], name: str) -> int:
    ports: list[int] = [
        p["containerPort"] for p in container.get("ports", []) if p.get("name") == name
    ]
    assert len(ports) == 1, f"container {container['name']} has no one port named {name!r}"
    return ports[0]


def _config_text() -> str:
    text: str = _one("ConfigMap", "grpc-model-gateway-config")["data"]["config.yaml"]
    return text


def _config() -> GatewayConfig:
    return build_config(yaml.safe_load(_config_text()))


def _selector(text: str) -> dict[str, str]:
    """An equality-based label selector (`a=b,c=d`) as a mapping."""
    pairs = [term.split("=", 1) for term in text.split(",")]
    assert all(len(pair) == 2 for pair in pairs), f"not an equality selector: {text!r}"
    return {key.strip(): value.strip() for key, value in pairs}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())
