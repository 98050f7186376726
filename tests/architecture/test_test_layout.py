"""The tests mirror the code: unit tests sit under tests/unit/<package>/ for the gateway
package they test (pure: no sockets, no processes), in-process servers and sockets under
tests/component/, real processes under tests/e2e/, what tests share under tests/support/;
and no test module imports another (what two tests share lives in support)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
NOT_PACKAGES = {"scripts"}  # the benchmark and attack scripts' own tests


def imported_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def test_no_test_module_imports_another() -> None:
    strays = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in imported_modules(path)
        if module.startswith("tests.") and module.rpartition(".")[2].startswith("test_")
    ]
    assert strays == []


def test_unit_tests_sit_under_the_package_they_test() -> None:
    packages = {p.name for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - packages <= NOT_PACKAGES
    assert not list((TESTS / "unit").glob("test_*.py"))  # none left at the top
