"""The committed generated code matches the .proto files, and the protos pass `buf lint`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    gen = _gen_protos()
    fresh = gen.generate(tmp_path)
    assert fresh, "no .proto files found under protos/"
    stale = []
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(committed.relative_to(ROOT)))
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale}"


def test_generated_modules_import_as_a_package() -> None:
    from gateway.admin.v1 import admin_pb2, admin_pb2_grpc

    assert admin_pb2.DESCRIPTOR.package == "gateway.admin.v1"
    assert "AdminService" in admin_pb2.DESCRIPTOR.services_by_name
    assert hasattr(admin_pb2_grpc, "AdminServiceStub")


def test_buf_lint() -> None:
    buf = Path(sys.executable).parent / "buf"
    assert buf.exists(), f"{buf} is missing: install the dev extra (buf-bin)"
    result = subprocess.run(
        [str(buf), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
