"""The two distributions: the gateway's wheel carries no simulator and no demo; the
simulator's (sim/, package gateway_sim) carries them and nothing of the gateway.

Each wheel is built offline (`pip wheel --no-index --no-deps --no-build-isolation`, with
the venv's setuptools: >= 77 through grpcio-tools, bdist_wheel built in) from a copy of
the sources, so no `build/` left in the checkout by an earlier build can leak into it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv*",  # .venv-engines too: gigabytes of torch (make engines), copied in minutes
    ".engines",
    ".image",  # make image's store: a root file system or two
    ".import_linter_cache",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "build",
    "dist",
    "*.egg-info",
)


def build_wheel(project: Path, out: Path) -> zipfile.ZipFile:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(project),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [wheel] = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def entry_points(wheel: zipfile.ZipFile) -> str:
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    return wheel.read(name).decode()


def test_the_gateway_wheel_has_no_simulator_and_no_demo(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=IGNORE)
    # As if the simulator's package sat next to gateway/: `gateway*` would take it in.
    (source / "gateway_sim").mkdir()
    (source / "gateway_sim" / "__init__.py").write_text("")
    with build_wheel(source, tmp_path / "wheel") as wheel:
        names = wheel.namelist()
        scripts = entry_points(wheel)
    packages = {name.split("/", 1)[0] for name in names if "/" in name}
    assert {"gateway/cli/main.py", "gateway/app/run.py", "gateway/app/server.py"} <= set(names)
    assert [p for p in packages if not p.endswith(".dist-info")] == ["gateway"]
    assert not [n for n in names if n.startswith(("gateway/sim/", "sim/", "gateway_sim"))]
    assert not [n for n in names if "demo" in n]
    assert "gateway = gateway.__main__:main" in scripts


def test_the_simulator_wheel_has_the_simulator_and_the_demo_only(tmp_path: Path) -> None:
    source = tmp_path / "sim"
    shutil.copytree(ROOT / "sim", source, ignore=IGNORE)
    with build_wheel(source, tmp_path / "wheel") as wheel:
        names = wheel.namelist()
        scripts = entry_points(wheel)
    packages = {name.split("/", 1)[0] for name in names if "/" in name}
    assert [p for p in packages if not p.endswith(".dist-info")] == ["gateway_sim"]
    assert {
        "gateway_sim/__init__.py",
        "gateway_sim/__main__.py",
        "gateway_sim/server.py",
        "gateway_sim/demo.py",
    } <= set(names)
    assert "gateway-sim = gateway_sim.__main__:main" in scripts
