"""The tests mirror the code: unit tests sit under tests/unit/<package>/ for the gateway
package they test (pure: no sockets, no processes), in-process servers and sockets under
tests/component/, real processes under tests/e2e/, what tests share under tests/support/;
and no test module imports another (what two tests share lives in support). conftest.py
holds pytest's hooks and fixtures only: nothing imports it. The scripts import nothing
from the tests (what both use lives in the simulator's package, gateway_sim), and the
benchmarks live in scripts/bench/."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SCRIPTS = ROOT / "scripts"
BENCH = SCRIPTS / "bench"
NOT_PACKAGES = {"scripts"}  # the benchmark and attack scripts' own tests
FLOORS = {"bare_relay.py", "floor_picker.py"}  # what the benchmarks measure against


def imported_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def imports_of(source: str) -> list[str]:
    """Every module an import names, `from a import b` as both `a` and `a.b` (b may be a
    module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
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


def _imports_tests(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def run_modules(source: str) -> list[str]:
    """The modules a process is started with (`python -m MODULE`): the string after "-m"
    in a list of arguments."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            found += [str(b) for a, b in itertools.pairwise(words) if a == "-m" and b]
    return found


def test_nothing_imports_the_conftest() -> None:
    strays = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        if path != TESTS / "conftest.py"
        for module in imports_of(path.read_text())
        if _imports_tests(module, "tests.conftest")
    ]
    assert strays == [], "process helpers live in tests/support/ (or gateway_sim)"


def test_the_scripts_import_nothing_from_the_tests() -> None:
    strays = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(SCRIPTS.rglob("*.py"))
        for module in imports_of(path.read_text()) + run_modules(path.read_text())
        if _imports_tests(module, "tests")
    ]
    assert strays == [], "what scripts and tests share lives in gateway_sim"


def test_the_benchmarks_live_in_scripts_bench() -> None:
    assert (BENCH / "__init__.py").is_file()
    strays = [
        path.relative_to(ROOT).as_posix()
        for path in sorted(SCRIPTS.rglob("*.py"))
        if (path.name.startswith("bench") or path.name in FLOORS) and path.parent != BENCH
    ]
    assert strays == []
    assert {path.name for path in BENCH.glob("*.py")} >= FLOORS


def test_the_import_checks_see_every_form() -> None:
    source = "from tests.conftest import x\nimport tests.conftest\nfrom tests import conftest\n"
    for line in source.splitlines():
        assert any(_imports_tests(m, "tests.conftest") for m in imports_of(line)), line
    assert not any(_imports_tests(m, "tests") for m in imports_of("import testsuite\n"))
    assert run_modules('[sys.executable, "-m", "tests.e2e.simhost"]') == ["tests.e2e.simhost"]
