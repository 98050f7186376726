"""`--processes N`: the processes' own series (`process_*`) and the build merged into one
exposition: from real ProcessCollector texts of real processes (this one and a child), and
through the supervisor's collector, which asks serving processes over gRPC (a stand-in
PeerService on 127.0.0.1 here) and merges its own series in."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.app.metrics import Metrics
from gateway.config import build_config
from gateway.peer.v1 import peer_pb2 as peer_pb
from gateway.peer.v1 import peer_pb2_grpc
from gateway.scale.merge import COMBINED, FIRST_WINS, ProcessesCollector, merge_expositions
from gateway.scale.supervisor import Supervisor
from tests.support.factories import make_registry

SUMMED = (
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
)


class Fixed:
    """A collector that serves given families, as the supervisor's would."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: list[Metric]) -> str:
    registry = CollectorRegistry()
    registry.register(Fixed(families))
    return generate_latest(registry).decode()


def samples(text: str) -> dict[str, float]:
    """Unlabelled samples by name (the process series have no labels)."""
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels
    }


def process_text(pid: int | str) -> str:
    registry = CollectorRegistry()
    ProcessCollector(pid=lambda: pid, registry=registry)
    return generate_latest(registry).decode()


def gateway_text() -> str:
    """A serving process's whole exposition, as PeerService.Metrics answers it."""
    return generate_latest(Metrics(make_registry(), CollectorRegistry()).prometheus).decode()


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A second real process: it waits on its stdin until the test ends."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


class Answers(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    """A serving process's PeerService, as far as the supervisor's scrape uses it."""

    def __init__(self, text: str) -> None:
        self._text = text

    def Metrics(self, request: peer_pb.MetricsRequest, context: Any) -> peer_pb.MetricsResponse:
        return peer_pb.MetricsResponse(text=self._text)


@pytest.fixture
def serving() -> Iterator[tuple[str, str]]:
    """A serving process's metrics text, and the address that answers it."""
    text = gateway_text()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    peer_pb2_grpc.add_PeerServiceServicer_to_server(Answers(text), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield text, f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(10)


def test_process_series_summed_earliest_start_largest_limit(
    child: subprocess.Popen[bytes],
) -> None:
    texts = [process_text("self"), process_text(child.pid)]
    mine, its = samples(texts[0]), samples(texts[1])
    merged_text = render(merge_expositions(texts))
    merged = samples(merged_text)
    for name in SUMMED:
        assert merged[name] == mine[name] + its[name], name
    assert merged["process_start_time_seconds"] == min(
        mine["process_start_time_seconds"], its["process_start_time_seconds"]
    )
    assert merged["process_max_fds"] == max(mine["process_max_fds"], its["process_max_fds"])
    # The merge keeps every family ProcessCollector makes, with its type, and adds none.
    families = {f.name: f.type for f in text_string_to_metric_families(merged_text)}
    assert families == {f.name: f.type for f in text_string_to_metric_families(texts[0])}
    assert set(COMBINED) <= set(families) and set(SUMMED) <= set(merged)
    assert "_created" not in merged_text


def test_combined_gauges_take_min_and_max_whatever_the_order() -> None:
    def text(start: float, max_fds: float, rss: float) -> str:
        return (
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {start}\n"
            "# TYPE process_max_fds gauge\n"
            f"process_max_fds {max_fds}\n"
            "# TYPE process_resident_memory_bytes gauge\n"
            f"process_resident_memory_bytes {rss}\n"
        )

    texts = [text(200.0, 1024, 10), text(100.0, 4096, 20), text(300.0, 2048, 40)]
    for order in (texts, texts[::-1]):
        assert samples(render(merge_expositions(order))) == {
            "process_start_time_seconds": 100.0,
            "process_max_fds": 4096.0,
            "process_resident_memory_bytes": 70.0,
        }


def test_build_info_is_one_however_many_processes() -> None:
    assert "gateway_build_info" in FIRST_WINS
    one = gateway_text()
    [info] = [f for f in merge_expositions([one, one, one]) if f.name == "gateway_build_info"]
    assert [s.value for s in info.samples] == [1.0]


def test_supervisor_scrape_merges_its_own_series_with_the_serving_processes(
    serving: tuple[str, str],
) -> None:
    text, address = serving
    own_text = process_text("self")  # fixed once, so every sum below is exact
    own = CollectorRegistry()
    own.register(Fixed(list(text_string_to_metric_families(own_text))))
    registry = CollectorRegistry()
    registry.register(ProcessesCollector(lambda: [address, address], [], own=own))
    scraped = generate_latest(registry).decode()
    got, one, sup = samples(scraped), samples(text), samples(own_text)
    assert got["gateway_serving_processes"] == 2.0  # the supervisor is not one of them
    for name in SUMMED:
        assert got[name] == 2 * one[name] + sup[name], name
    start = "process_start_time_seconds"
    assert got[start] == min(one[start], sup[start])
    assert "_created" not in scraped
    assert [
        s.value
        for f in text_string_to_metric_families(scraped)
        if f.name == "gateway_build_info"
        for s in f.samples
    ] == [1.0]


def test_supervisor_alone_shows_its_own_series() -> None:
    """The supervisor's registry as it serves it, no serving process reachable (all
    restarting): its own process series and the build stay."""
    registry = Supervisor(build_config({"processes": 2})).prometheus_registry()
    assert registry.get_sample_value("gateway_serving_processes") == 0.0
    assert (registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
    assert (registry.get_sample_value("process_cpu_seconds_total") or 0) > 0
    [info] = [f for f in registry.collect() if f.name == "gateway_build_info"]
    assert [s.value for s in info.samples] == [1.0]
