"""The proxy shows the rest of the gateway one surface: outside gateway/proxy, code imports
`gateway.proxy` (its `__init__` names what may be used), never one of its modules."""

from __future__ import annotations

import ast
from pathlib import Path

import gateway

ROOT = Path(gateway.__file__).parent
SURFACED = ("proxy",)


def reaching_in() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        inside = path.relative_to(ROOT).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if isinstance(node, ast.ImportFrom):
                modules = [node.module] if node.module else []
            else:
                modules = [alias.name for alias in node.names]
            for module in modules:
                parts = module.split(".")
                if (
                    len(parts) > 2
                    and parts[0] == "gateway"
                    and parts[1] in SURFACED
                    and parts[1] != inside
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}")
    return found


def test_nothing_outside_the_proxy_imports_its_modules() -> None:
    assert reaching_in() == []
