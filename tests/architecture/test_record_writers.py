"""The call record has one writer: the call (gateway/proxy/call.py: `Call` and its client
side). The stages, dispatch and the legs say what happened through the call's methods;
nothing else assigns a record's field or grows one of its lists. Read from the source,
so a new write elsewhere fails here, whatever path runs it."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
WRITER = "gateway/proxy/call.py"
# The tracer notes the trace id as it opens the call's span: the one field it owns.
ALSO = {("gateway/observability/tracing.py", "trace_id")}
GROWING = {"append", "extend", "setdefault", "clear", "update", "called"}


def _on_record(node: ast.expr) -> bool:
    """`record.x`, `self.record.x`, `job.record.x`, `self._record.x`: a record's field."""
    if not isinstance(node, ast.Attribute):
        return False
    base = node.value
    if isinstance(base, ast.Name):
        return base.id in ("record", "_record")
    return isinstance(base, ast.Attribute) and base.attr in ("record", "_record")


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _flatten(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if _on_record(target):
                assert isinstance(target, ast.Attribute) and isinstance(node, ast.stmt)
                found.append((node.lineno, target.attr))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, owner = node.func.attr, node.func.value
            if method in GROWING and (_on_record(owner) or _is_record(owner)):
                found.append((node.lineno, method))
    return found


def _is_record(node: ast.expr) -> bool:
    """`record.called(...)`: a method of the record itself that writes it."""
    if isinstance(node, ast.Name):
        return node.id in ("record", "_record")
    return isinstance(node, ast.Attribute) and node.attr in ("record", "_record")


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        return [t for element in target.elts for t in _flatten(element)]
    return [target]


def test_only_the_call_writes_the_call_record() -> None:
    strays = []
    for path in sorted(GATEWAY.rglob("*.py")):
        name = path.relative_to(GATEWAY.parent).as_posix()
        if name in (WRITER, "gateway/observability/record.py"):
            continue
        for line, field in _writes(ast.parse(path.read_text(), name)):
            if (name, field) not in ALSO:
                strays.append(f"{name}:{line} writes record.{field}")
    assert not strays, "\n".join(strays)


def test_the_check_sees_a_write() -> None:
    """The checker itself: each form of write is found."""
    source = (
        "record.code = 'OK'\n"
        "self.record.attempts += 1\n"
        "job.record.rooms.append(1)\n"
        "a, record.lowered = 1, True\n"
        "call.record.called(leg, worker)\n"
    )
    assert sorted(field for _, field in _writes(ast.parse(source))) == [
        "append",
        "attempts",
        "called",
        "code",
        "lowered",
    ]
