"""The installed gateway's version: what `gateway --version` prints and
`gateway_build_info` carries."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "grpc-model-gateway"


def installed_version() -> str:
    """The installed distribution's version ("unknown" when run from a tree never
    installed)."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
