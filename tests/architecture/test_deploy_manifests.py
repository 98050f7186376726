"""deploy/kubernetes: the manifests validate against the Kubernetes API schema (offline,
with kubernetes-validate, strict: unknown fields are errors) and agree with each other and
with the gateway's own config (probes, drain, RBAC, selectors, the ConfigMap's config).
(The InferencePool component: tests/architecture/test_deploy_inference_pool.py.)"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from gateway.config import KubernetesDiscovery, parse_address
from gateway.core.roles import Role, Runtime
from gateway.services.health import PROBE_NAMES
from tests.support.manifests import (
    DEPLOY,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    _all_documents,
    _config,
    _container_port,
    _documents,
    _gateway_deployment,
    _manifest_files,
    _matches,
    _one,
    _selector,
)

EXAMPLES = {"example-workers.yaml"}  # applied on their own, not by the kustomization


def _gateway_container() -> dict[str, Any]:
    pod = _gateway_deployment()["spec"]["template"]["spec"]
    containers: list[dict[str, Any]] = pod["containers"]
    assert [c["name"] for c in containers] == ["gateway"]
    return containers[0]


# -- the Kubernetes API schema -------------------------------------------------------------


def test_every_manifest_is_in_the_kustomization_or_an_example() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == NAMESPACE
    listed = set(kustomization["resources"])
    assert len(listed) == len(kustomization["resources"]), "a resource is listed twice"
    on_disk = {path.name for path in _manifest_files()}
    assert listed == on_disk - EXAMPLES
    assert on_disk >= EXAMPLES


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    ("where", "doc"), [pytest.param(where, doc, id=where) for where, doc in _all_documents()]
)
def test_manifest_validates_against_the_kubernetes_schema(
    where: str, doc: dict[str, Any], version: str
) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{where} (Kubernetes {version}) at {path or '<top>'}: {exc.message}")
    namespaced = doc["kind"] != "Namespace"
    assert doc["metadata"].get("namespace") == (NAMESPACE if namespaced else None), where


def test_strict_validation_refuses_an_unknown_field() -> None:
    """The check above can fail: a misspelt field is an error, not silently ignored."""
    doc = _gateway_deployment()
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)


# -- RBAC ----------------------------------------------------------------------------------


def test_role_grants_exactly_reading_pods() -> None:
    role = _one("Role")
    assert len(role["rules"]) == 1
    rule = role["rules"][0]
    assert set(rule) == {"apiGroups", "resources", "verbs"}  # no resourceNames, no URLs
    assert rule["apiGroups"] == [""]
    assert rule["resources"] == ["pods"]
    assert sorted(rule["verbs"]) == ["get", "list", "watch"]
    assert not [d for _, d in _all_documents() if d["kind"].startswith("Cluster")]


def test_role_binding_binds_the_role_to_the_gateway_service_account() -> None:
    binding, role, account = _one("RoleBinding"), _one("Role"), _one("ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = _gateway_deployment()["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod.get("automountServiceAccountToken", True) is True


# -- the gateway's Deployment ----------------------------------------------------------------


def test_probes_are_grpc_health_probes_on_the_grpc_container_port() -> None:
    container = _gateway_container()
    grpc_port = _container_port(container, "grpc")
    assert grpc_port == parse_address(_config().listen, "listen")[1]
    for kind in ("readinessProbe", "livenessProbe"):
        probe = container[kind]
        handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & set(probe)
        assert handlers == {"grpc"}, f"{kind} must be a native gRPC probe, not {handlers}"
        assert probe["grpc"]["port"] == grpc_port, kind
        # a name the gateway's health service answers without an API key
        assert probe["grpc"].get("service", "") in PROBE_NAMES, kind


def test_termination_grace_outlasts_the_drain() -> None:
    drain = _config().drain
    grace = _gateway_deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain.delay_s + drain.grace_s, (
        f"terminationGracePeriodSeconds {grace} must exceed drain.delay_s {drain.delay_s} "
        f"+ drain.grace_s {drain.grace_s}, with a margin"
    )


def test_gateway_runs_the_mounted_config() -> None:
    deployment = _gateway_deployment()
    container = _gateway_container()
    command = [*container.get("command", []), *container.get("args", [])]
    assert command[:2] == ["gateway", "serve"]
    assert command[command.index("--config") + 1] == "/etc/gateway/config.yaml"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (config_mount,) = (m for m in mounts.values() if m["mountPath"] == "/etc/gateway")
    source = volumes[config_mount["name"]]["configMap"]
    assert source["name"] == _one("ConfigMap")["metadata"]["name"]
    assert {item["key"]: item["path"] for item in source.get("items", [])} in (
        {},
        {"config.yaml": "config.yaml"},
    )


def test_gateway_container_is_locked_down_and_sized() -> None:
    pod = _gateway_deployment()["spec"]["template"]["spec"]
    container = _gateway_container()
    security = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert security["runAsNonRoot"] is True
    assert security.get("runAsUser", 1) != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "add" not in security["capabilities"]
    # a read-only root needs a writable TMPDIR for --processes N's control sockets
    assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][bound]), bound


# -- the Service -----------------------------------------------------------------------------


def test_service_selects_the_gateway_pods_and_its_ports() -> None:
    service, deployment = _one("Service"), _gateway_deployment()
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"]
    assert _matches(service["spec"]["selector"], pod_labels)
    assert _matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    assert _matches(_one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    container = _gateway_container()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "metrics"}  # the admin port stays inside the pod
    assert ports["grpc"]["appProtocol"] in ("grpc", "kubernetes.io/h2c")
    for name, port in ports.items():
        target = port["targetPort"]
        number = _container_port(container, target) if isinstance(target, str) else target
        assert number == _container_port(container, name), name
    config = _config()
    assert config.metrics.listen is not None
    assert parse_address(config.metrics.listen, "metrics")[1] == _container_port(
        container, "metrics"
    )


# -- the ConfigMap's config ------------------------------------------------------------------


def test_configmap_config_builds_for_the_gateway() -> None:
    config = _config()
    assert config.listen == "0.0.0.0:50051"
    assert config.metrics.listen == "0.0.0.0:9464"
    admin_host, admin_port = parse_address(config.admin.listen, "admin.listen")
    assert (admin_host, admin_port) == ("127.0.0.1", 50052)  # loopback: no token needed
    assert config.workers == ()
    assert all(isinstance(entry, KubernetesDiscovery) for entry in config.discovery)
    prefill, decode = config.discovery
    assert isinstance(prefill, KubernetesDiscovery) and isinstance(decode, KubernetesDiscovery)
    assert prefill.selector == "app=sglang,llm-d.ai/role=prefill"
    assert decode.selector == "app=sglang,llm-d.ai/role=decode"
    assert (prefill.role, decode.role) == (Role.PREFILL, Role.DECODE)
    for entry in (prefill, decode):
        assert entry.port == "grpc"
        assert entry.model == "llama-3-8b"
        assert entry.runtime is Runtime.SGLANG
        assert entry.namespace is None  # the gateway's own: what the Role grants
        assert entry.kubeconfig is None  # in-cluster credentials
    assert prefill.bootstrap_port_annotation == "sglang.ai/bootstrap-port"
    assert decode.bootstrap_port_annotation is None


def test_example_workers_are_what_the_discovery_selects() -> None:
    workers = _documents(DEPLOY / "example-workers.yaml")
    assert {doc["kind"] for doc in workers} == {"Deployment"}
    for entry in _config().discovery:
        assert isinstance(entry, KubernetesDiscovery)
        selector = _selector(entry.selector)
        chosen = [
            doc
            for doc in workers
            if _matches(selector, doc["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(chosen) == 1, f"{entry.selector} selects {len(chosen)} example Deployments"
        template = chosen[0]["spec"]["template"]
        assert _matches(
            chosen[0]["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]
        )
        (container,) = template["spec"]["containers"]
        assert isinstance(entry.port, str)
        port = _container_port(container, entry.port)
        for kind in ("readinessProbe", "livenessProbe"):
            assert container[kind]["grpc"]["port"] == port, kind
        annotations = template["metadata"].get("annotations", {})
        if entry.bootstrap_port_annotation is None:
            assert not [key for key in annotations if "bootstrap" in key]
            continue
        bootstrap = annotations[entry.bootstrap_port_annotation]
        assert isinstance(bootstrap, str) and bootstrap.isdigit()
        assert int(bootstrap) == _container_port(container, "bootstrap")
        assert f"--disaggregation-bootstrap-port={bootstrap}" in container["command"]
