"""Regenerate the Python code of the gateway's own protos (its admin API).

    .venv/bin/python scripts/gen_protos.py            # rewrite gateway/admin/v1/*_pb2*
    .venv/bin/python scripts/gen_protos.py --out DIR  # write under DIR instead (tests)

protoc runs with `-Iprotos` and the output root `.`, so `protos/gateway/admin/v1/x.proto`
becomes `gateway/admin/v1/x_pb2.py` (+ `.pyi`, `_grpc.py`) and imports read
`from gateway.admin.v1 import x_pb2`. The generated files are committed, so running the
gateway needs no grpcio-tools; tests/unit/test_protos.py checks they are up to date.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    """Every .proto under protos/, relative to it (the import paths protoc sees)."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generated_paths(out: Path) -> list[Path]:
    """The files a generation writes under `out`, in a stable order."""
    paths: list[Path] = []
    for proto in proto_files():
        stem = out / proto.with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            paths.append(stem.parent / (stem.name + suffix))
    return paths


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over every proto; returns the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(p) for p in proto_files()),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit status {code}")
    return generated_paths(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out) if path.is_relative_to(args.out) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
