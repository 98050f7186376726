"""deploy/kubernetes: the manifests validate against the Kubernetes API schema (offline,
with kubernetes-validate, strict: unknown fields are errors) and agree with each other and
with the gateway's own config (probes, drain, RBAC, selectors, the ConfigMap's config);
so does the InferencePool component (inference-pool/), whose custom resources are
checked against the fields inference-pool.md names."""

from __future__ import annotations

import copy
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import trustme
import yaml
from kubernetes_validate.utils import ValidationError

from gateway.config import GatewayConfig, KubernetesDiscovery, build_config, parse_address
from gateway.core.roles import Role, Runtime
from gateway.services.health import PROBE_NAMES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# Schemas bundled with kubernetes-validate 1.37.0: 1.25 .. 1.37. The newest, and an
# older release still common in managed clusters.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")
NAMESPACE = "model-gateway"
NOT_KUBERNETES = {"kustomization.yaml"}  # kustomize's own file, no API kind
EXAMPLES = {"example-workers.yaml"}  # applied on their own, not by the kustomization


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


def _gateway_container() -> dict[str, Any]:
    pod = _gateway_deployment()["spec"]["template"]["spec"]
    containers: list[dict[str, Any]] = pod["containers"]
    assert [c["name"] for c in containers] == ["gateway"]
    return containers[0]


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
