"""deploy/kubernetes/inference-pool: the InferencePool component's files parse and are used,
the picker's Service and the patched Deployment validate against the Kubernetes API schema
(offline, with kubernetes-validate), agree with each other and with the gateway's config,
and its custom resources carry the fields inference-pool.md names; kustomize builds it as
these tests read it."""

from __future__ import annotations

import copy
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import trustme
import yaml
from kubernetes_validate.utils import ValidationError

from gateway.config import KubernetesDiscovery, parse_address
from tests.support.manifests import (
    DEPLOY,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    _config,
    _config_text,
    _container_port,
    _documents,
    _gateway_deployment,
    _matches,
    _selector,
)

# -- the InferencePool component (inference-pool/, inference-pool.md) -----------------------

COMPONENT = DEPLOY / "inference-pool"
PICKER_SERVICE = "grpc-model-gateway-picker"
# The InferencePool fields inference-pool.md says were checked against the extension's
# CRD (inference.networking.k8s.io/v1): no cluster here, so nothing else validates them.
POOL_SPEC = {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
PICKER_REF = {"group", "kind", "name", "port", "failureMode"}


def _component() -> dict[str, Any]:
    kustomization: dict[str, Any] = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    return kustomization


def _component_one(kind: str) -> dict[str, Any]:
    found = [
        doc
        for name in _component()["resources"]
        for doc in _documents(COMPONENT / name)
        if doc["kind"] == kind
    ]
    assert len(found) == 1, f"expected one {kind} in inference-pool/, found {len(found)}"
    return found[0]


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902's `add` and `replace` (what the component's patch uses), on a copy."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = op["path"].lstrip("/").split("/")
        target: Any = doc
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if isinstance(target, list):
            index = len(target) if last == "-" else int(last)
            if op["op"] == "add":
                target.insert(index, op["value"])
            else:
                target[index] = op["value"]
        else:
            assert op["op"] == "add" or last in target, op["path"]  # replace: it exists
            target[last] = op["value"]
    return doc


def _picker_deployment() -> dict[str, Any]:
    """The gateway's Deployment with the component's patch applied."""
    (patch,) = _component()["patches"]
    assert patch["target"] == {
        "group": "apps",
        "version": "v1",
        "kind": "Deployment",
        "name": _gateway_deployment()["metadata"]["name"],
    }
    ops = yaml.safe_load((COMPONENT / patch["path"]).read_text())
    return _json_patch(_gateway_deployment(), ops)


def _picker_script() -> str:
    (container,) = _picker_deployment()["spec"]["template"]["spec"]["containers"]
    shell, flag, script = container["command"]
    assert (shell, flag) == ("sh", "-c")
    assert isinstance(script, str)
    return script


def test_every_component_file_parses_and_is_used() -> None:
    component = _component()
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert component["kind"] == "Component"
    used = {*component["resources"], *(p["path"] for p in component["patches"])}
    on_disk = {p.name for p in COMPONENT.glob("*.yaml")} - {"kustomization.yaml"}
    assert used == on_disk
    for name in on_disk:
        assert list(yaml.safe_load_all((COMPONENT / name).read_text())), name
    # Off by default: the gateway's kustomization names it only in a comment.
    assert "components" not in yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_picker_service_and_the_patched_deployment_validate(version: str) -> None:
    for doc in (_component_one("Service"), _picker_deployment()):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']} (Kubernetes {version}) at {path or '<top>'}: {exc.message}")
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_the_picker_service_reaches_the_picker_port() -> None:
    service, deployment = _component_one("Service"), _picker_deployment()
    assert service["metadata"]["name"] == PICKER_SERVICE
    assert _matches(
        service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    (port,) = service["spec"]["ports"]
    assert port["appProtocol"] == "kubernetes.io/h2c"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    picker_port = _container_port(container, port["targetPort"])
    assert f"--picker-listen 0.0.0.0:{picker_port}" in _picker_script()
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_the_inference_pool_names_the_workers_and_the_picker() -> None:
    pool, service = _component_one("InferencePool"), _component_one("Service")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == NAMESPACE
    spec = pool["spec"]
    assert set(spec) <= POOL_SPEC and set(spec["endpointPickerRef"]) <= PICKER_REF
    assert spec["appProtocol"] == "kubernetes.io/h2c"  # the CRD's values: http, this
    ref = spec["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["name"] == PICKER_SERVICE
    assert ref["failureMode"] == "FailClose"
    assert ref["port"] == {"number": service["spec"]["ports"][0]["port"]}  # the Service's
    # The pool's pods are the ones the gateway's discovery finds, at the same port.
    selector = spec["selector"]["matchLabels"]
    workers = _documents(DEPLOY / "example-workers.yaml")
    for entry in _config().discovery:
        assert isinstance(entry, KubernetesDiscovery)
        assert _selector(entry.selector).items() >= selector.items()
    for doc in workers:
        template = doc["spec"]["template"]
        assert _matches(selector, template["metadata"]["labels"])
        (container,) = template["spec"]["containers"]
        assert spec["targetPorts"] == [{"number": _container_port(container, "grpc")}]


def test_the_route_sends_every_call_to_the_pool() -> None:
    route, pool = _component_one("HTTPRoute"), _component_one("InferencePool")
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]


@pytest.mark.parametrize(("pod_ip", "relay"), [("10.1.2.3", "10.1.2.3"), ("fd00::7", "[fd00::7]")])
def test_the_patched_command_makes_the_pod_ip_the_relay_address(
    tmp_path: Path, pod_ip: str, relay: str
) -> None:
    """The container's script, run with its paths in `tmp_path` and `gateway serve` as
    `gateway check-config` (the same flags, checked as serve would, nothing started)."""
    mounted = "/etc/gateway/config.yaml"
    serve = "exec gateway serve"
    script = _picker_script()
    # the mounted config served, run once: what is replaced below is all there is
    assert [script.count(part) for part in (mounted, serve)] == [1, 1]
    (tmp_path / "config.yaml").write_text(_config_text())
    script = script.replace(mounted, str(tmp_path / "config.yaml")).replace(
        serve, f"exec {shlex.quote(sys.executable)} -m gateway check-config"
    )
    # The picker port's TLS, from the Secret's mount: a certificate made here.
    secret = "/etc/gateway-picker-tls"
    assert script.count(secret) == 2
    made = trustme.CA().issue_cert("grpc-model-gateway-picker")
    made.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    made.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    script = script.replace(secret, str(tmp_path))
    result = subprocess.run(
        ["sh", "-c", script],
        env={**os.environ, "POD_IP": pod_ip},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    picker = yaml.safe_load(result.stdout)["picker"]
    assert picker["listen"] == "0.0.0.0:9002"
    assert picker["tls"]["cert"] == str(tmp_path / "tls.crt")
    assert picker["relay_address"] == f"{relay}:{parse_address(_config().listen, 'listen')[1]}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl (kustomize)")
def test_kustomize_builds_the_component_as_these_tests_read_it(tmp_path: Path) -> None:
    """With the component turned on as inference-pool.md says, `kubectl kustomize` (no
    cluster needed) builds the patched Deployment these tests check, and the rest."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(DEPLOY, tree)
    kustomization = tree / "kustomization.yaml"
    off = "# components:\n#   - inference-pool\n"
    assert kustomization.read_text().count(off) == 1
    kustomization.write_text(kustomization.read_text().replace(off, off.replace("# ", "")))
    result = subprocess.run(
        ["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}
    assert built[("Deployment", "grpc-model-gateway")] == _picker_deployment()
    for kind in ("Service", "InferencePool", "HTTPRoute"):
        doc = _component_one(kind)
        assert built[(kind, doc["metadata"]["name"])] == doc
