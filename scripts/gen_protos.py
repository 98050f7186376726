"""Regenerate the Python code of the gateway's own protos (its admin API, peer calls,
the ORCA load report it serves, and the external processing protocol its picker serves).

    .venv/bin/python scripts/gen_protos.py            # rewrite gateway/*/v*/*_pb2*
    .venv/bin/python scripts/gen_protos.py --out DIR  # write under DIR instead (tests)

protoc runs with `-Iprotos` and the output root `.`, so `protos/gateway/admin/v1/x.proto`
becomes `gateway/admin/v1/x_pb2.py` (+ `.pyi`, `_grpc.py`) and imports read
`from gateway.admin.v1 import x_pb2`. The generated files are committed, so running the
gateway needs no grpcio-tools; tests/architecture/test_protos.py checks they are up to date.

Protos declared under another project's package keep that project's file paths (so their
descriptors name the same files as upstream's), but their Python modules are moved under
the gateway's own package (`RELOCATED`) and their imports rewritten to match: a top-level
`xds` package would clash with the xds-protos distribution's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# Upstream proto directory -> the gateway's package its Python modules go to.
RELOCATED = {
    "xds/data/orca/v3": "gateway/orca/v3",  # ORCA, from github.com/cncf/xds
    "xds/service/orca/v3": "gateway/orca/v3",
    # Envoy's external processing protocol, from github.com/envoyproxy/envoy (api/)
    "envoy/config/core/v3": "gateway/picker/v3",
    "envoy/type/v3": "gateway/picker/v3",
    "envoy/extensions/filters/http/ext_proc/v3": "gateway/picker/v3",
    "envoy/service/ext_proc/v3": "gateway/picker/v3",
}


def proto_files() -> list[Path]:
    """Every .proto under protos/, relative to it (the import paths protoc sees)."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def _module_dir(proto: Path) -> Path:
    """Where the Python modules of `proto` (relative to protos/) go, relative to the root."""
    return Path(RELOCATED.get(proto.parent.as_posix(), proto.parent.as_posix()))


def _relocate_imports(text: str) -> str:
    """`from xds.data.orca.v3 import x_pb2` -> `from gateway.orca.v3 import x_pb2`."""
    for upstream, module_dir in RELOCATED.items():
        dotted, target = upstream.replace("/", "."), module_dir.replace("/", ".")
        text = text.replace(f"from {dotted} import ", f"from {target} import ")
    return text


def generated_paths(out: Path) -> list[Path]:
    """The files a generation writes under `out`, in a stable order."""
    paths: list[Path] = []
    for proto in proto_files():
        for suffix in SUFFIXES:
            paths.append(out / _module_dir(proto) / (proto.stem + suffix))
    return paths


def generate(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over every proto; returns the files written."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(prefix="gen-protos-") as scratch:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *(str(p) for p in proto_files()),
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit status {code}")
        for proto in proto_files():
            for suffix in SUFFIXES:
                name = proto.stem + suffix
                written = Path(scratch) / proto.parent / name
                target = out / _module_dir(proto) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(_relocate_imports(written.read_text()))
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
