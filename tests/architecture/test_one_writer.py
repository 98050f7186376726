"""A worker is the one writer of its signals, a cluster of its workers, policy and
limits: nowhere in the gateway's source but gateway/upstream/worker.py (cluster.py) is such
a field assigned (plain, augmented or in a tuple); the others go through their methods."""

from __future__ import annotations

import ast
from pathlib import Path

import gateway
from gateway.upstream.registry import Registry

SIGNALS = frozenset(
    {
        "status",
        "status_cause",
        "connected",
        "draining",
        "probe",
        "load",
        "load_error",
        "inflight",
        "idle",
        "outlier",
        "sources",
        "in_service",
        "loras",
        "lora_calls",
        "lora_changes",
    }
)
CLUSTER_FIELDS = frozenset({"workers", "policy", "limits", "key"})
FLEET = Path(gateway.__file__).parent / "upstream"
OWNERS = {FLEET / "worker.py": SIGNALS, FLEET / "cluster.py": CLUSTER_FIELDS}
# Fields of the same names on other objects are not the worker's: the gateway's own state
# (`self.`), and protobuf messages of the admin API, which are named `*message` (a rule of
# the tree, so no list of exceptions is needed).
MESSAGE_SUFFIX = "message"


def assigned(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, object, field) of every attribute assignment."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute):
                found.append((target.lineno, ast.unparse(target.value), target.attr))
    return found


def writes_outside(owner: Path, fields: frozenset[str]) -> list[str]:
    root = FLEET.parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path == owner or "_pb2" in path.name:
            continue
        where = path.relative_to(root).as_posix()
        for line, obj, attr in assigned(ast.parse(path.read_text())):
            if attr in fields and obj != "self" and not obj.endswith(MESSAGE_SUFFIX):
                bad.append(f"{where}:{line}: {obj}.{attr}")
    return bad


def test_no_module_but_the_worker_assigns_its_signals() -> None:
    assert writes_outside(FLEET / "worker.py", SIGNALS) == []


def test_no_module_but_the_cluster_assigns_its_fields() -> None:
    assert writes_outside(FLEET / "cluster.py", CLUSTER_FIELDS) == []


def test_the_check_sees_each_form_of_assignment() -> None:
    source = "w.load = 1\nworker.inflight += 1\nw.connected, x.probe = a, b\nself.load = 2\n"
    found = {(obj, attr) for _, obj, attr in assigned(ast.parse(source)) if attr in SIGNALS}
    assert found == {
        ("w", "load"),
        ("worker", "inflight"),
        ("w", "connected"),
        ("x", "probe"),
        ("self", "load"),
    }


# A worker's sub-objects (its active-health probe state, its outlier detector, its load
# report) are written by their own methods only: `worker.probe.x = ...` anywhere is a
# second writer. The load report is frozen; the others' owners are their modules.
SUB_OBJECTS = {
    "probe": FLEET / "signals" / "probe.py",
    "outlier": FLEET / "signals" / "outlier.py",
    "load": FLEET / "signals" / "load.py",
}


def sub_object_writes() -> list[str]:
    root = FLEET.parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        if "_pb2" in path.name:
            continue
        where = path.relative_to(root).as_posix()
        for line, obj, attr in assigned(ast.parse(path.read_text())):
            owner = obj.rpartition(".")[2]
            if obj.startswith("message."):  # an admin API message's own `load` field
                continue
            if owner in SUB_OBJECTS and obj != "self" and path != SUB_OBJECTS[owner]:
                bad.append(f"{where}:{line}: {obj}.{attr}")
    return bad


def test_no_module_writes_into_a_workers_probe_outlier_or_load() -> None:
    assert all(path.is_file() for path in SUB_OBJECTS.values())
    assert sub_object_writes() == []


def test_the_check_sees_a_write_into_a_sub_object() -> None:
    source = "worker.probe.failures = 3\nw.outlier.state = s\nself.probe = p\n"
    found = {(obj, attr) for _, obj, attr in assigned(ast.parse(source))}
    assert ("worker.probe", "failures") in found and ("w.outlier", "state") in found


def calls_of(method: str) -> list[str]:
    """Where the gateway calls `.method(...)` on anything."""
    root = FLEET.parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == method
            ):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_a_signal_carries_its_consequence() -> None:
    """A worker's signal methods derive its status and tell its registry themselves: no
    one re-derives a worker's status after changing a signal, and the registry has no
    method for it."""
    assert [c for c in calls_of("restatus") if not c.startswith("upstream/worker.py")] == []
    assert not hasattr(Registry, "update")
