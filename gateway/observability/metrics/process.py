"""The process itself: its resources (CPU, memory, file descriptors, start time), and what
it runs (the gateway's version, Python's, grpcio's)."""

from __future__ import annotations

import platform

import grpc
from prometheus_client import CollectorRegistry, Gauge, ProcessCollector

from gateway.core.version import installed_version


def process_series(prometheus: CollectorRegistry) -> None:
    """The `process_*` series of this process (read from /proc at scrape time)."""
    ProcessCollector(registry=prometheus)


def build_series(prometheus: CollectorRegistry) -> None:
    """`gateway_build_info`: 1, its labels saying what runs (so a dashboard can tell an
    upgrade's processes apart)."""
    info = Gauge(
        "gateway_build_info",
        "1, labelled with the gateway's version and the Python and grpcio it runs on",
        ["version", "python", "grpcio"],
        registry=prometheus,
    )
    info.labels(installed_version(), platform.python_version(), grpc.__version__).set(1)
