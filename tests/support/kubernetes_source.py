"""The Kubernetes source run against the stand-in API server (tests/support/fakes/apiserver.py),
for the discovery tests: the stand-in as a fixture (`api`), retries and relists made fast
(`fast`), a source run with its reports kept in order (`watching`), and what a report
says of a pod."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.config import KubernetesDiscovery
from gateway.discovery import kubernetes
from gateway.discovery.kubernetes import KubernetesSource
from gateway.discovery.source import Discovered
from tests.support.fakes.apiserver import ApiServer, running

NS = "serving"
WORKER = {"app": "worker"}
GRPC = {"grpc": 9000, "metrics": 9100}
WAIT_S = 5.0
Report = list[Discovered]


class Run:
    """A source running against the stand-in, its reports kept in order."""

    def __init__(self, source: KubernetesSource) -> None:
        self.source = source
        self.reports: list[Report] = []

    def report(self, hosts: Sequence[Discovered]) -> None:
        self.reports.append(list(hosts))

    @property
    def last(self) -> Report | None:
        return self.reports[-1] if self.reports else None

    async def report_where(self, check: Callable[[Report], bool], after: int = 0) -> Report:
        """The first report from the `after`th on (or the latest) that passes `check`."""
        deadline = time.monotonic() + WAIT_S
        seen = after
        while True:
            for report in self.reports[seen:]:
                if check(report):
                    return report
            seen = max(seen, len(self.reports))
            if time.monotonic() > deadline:
                raise AssertionError(f"no such report in {WAIT_S} s; last: {self.last}")
            await asyncio.sleep(0.01)


def state(report: Report, pod: str) -> bool | None:
    """The pod's host in the report: in service (True), out of it (False), absent (None)."""
    hosts = [h for h in report if h.origin == f"kubernetes:{NS}/{pod}"]
    assert len(hosts) <= 1
    return hosts[0].in_service if hosts else None


def host(report: Report, pod: str) -> Discovered:
    (found,) = [h for h in report if h.origin == f"kubernetes:{NS}/{pod}"]
    return found


def ready_pod(api: ApiServer, name: str, ip: str, **kwargs: Any) -> None:
    kwargs.setdefault("labels", WORKER)
    kwargs.setdefault("ports", GRPC)
    api.add_pod(NS, name, ip=ip, phase="Running", ready=True, **kwargs)


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with running(token="secret-token") as server:
        yield server


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries and relists in hundredths of a second, not seconds."""
    monkeypatch.setattr(kubernetes, "BACKOFF_MIN_S", 0.05)
    monkeypatch.setattr(kubernetes, "BACKOFF_MAX_S", 0.2)
    monkeypatch.setattr(kubernetes, "MIN_RELIST_S", 0.05)


@contextlib.asynccontextmanager
async def watching(api: ApiServer, tmp_path: Path, **settings: Any) -> AsyncIterator[Run]:
    """A source of `settings` (default: port grpc, app=worker, model m) with a kubeconfig
    naming the stand-in and NS as the context's namespace, run until the block ends."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    fields: dict[str, Any] = {"port": "grpc", "selector": "app=worker", "model": "m"}
    fields.update(settings)
    config = KubernetesDiscovery(source="kubernetes", kubeconfig=str(kubeconfig), **fields)
    run = Run(KubernetesSource(config))
    task = asyncio.ensure_future(run.source.run(run.report))
    try:
        yield run
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
