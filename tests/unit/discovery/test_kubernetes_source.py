"""The Kubernetes source against the stand-in API server (tests/support/fakes/apiserver.py) on an
ephemeral port, through lightkube as in production: what it reports as pods come, change
and go, how it mends an expired or broken watch, and what it keeps when the server is
down. Every wait is a bounded poll on the reports or the server's counters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gateway.config import KubernetesDiscovery
from gateway.discovery import kubernetes
from gateway.discovery.kubernetes import KubernetesSource
from tests.support import kubernetes_source
from tests.support.fakes.apiserver import ApiServer
from tests.support.kubernetes_source import GRPC, NS, WORKER, Run, host, ready_pod, state, watching
from tests.support.waits import until

api = kubernetes_source.api  # the fixture (tests/support/kubernetes_source.py)
fast = kubernetes_source.fast  # the fixture (tests/support/kubernetes_source.py)


# -- a pod's life ------------------------------------------------------------------------


async def test_a_pod_is_reported_in_service_only_while_running_ready_and_not_terminating(
    api: ApiServer, tmp_path: Path
) -> None:
    api.add_pod(NS, "w-0", labels=WORKER, ports=GRPC)  # Pending, no IP yet
    async with watching(api, tmp_path) as run:
        await run.report_where(lambda r: r == [])
        steps: list[tuple[Callable[[], None], bool | None]] = [
            (lambda: api.set_phase(NS, "w-0", "Running", ip="10.1.0.7"), False),
            (lambda: api.set_ready(NS, "w-0", True), True),
            (lambda: api.set_ready(NS, "w-0", False), False),
            (lambda: api.set_ready(NS, "w-0", True), True),
            (lambda: api.mark_terminating(NS, "w-0"), None),
        ]
        for step, expected in steps:
            count = len(run.reports)
            step()
            await run.report_where(lambda r, e=expected: state(r, "w-0") is e, after=count)  # type: ignore[misc]
        # Deleted once terminating: no change, no report (the next one comes with w-1).
        api.delete_pod(NS, "w-0")
        ready_pod(api, "w-1", "10.1.0.8")
        await run.report_where(lambda r: state(r, "w-1") is True)
        # One report per watch event that changed something, each the whole set.
        seen = [state(r, "w-0") for r in run.reports]
        assert seen == [None, False, True, False, True, None, None]
        assert host(run.reports[1], "w-0").spec.address == "10.1.0.7:9000"
        assert run.source.stats.hosts == 1
        assert run.source.stats.updates == len(run.reports)
        assert api.lists == 1 and api.watches == 1


async def test_an_update_that_changes_no_host_is_not_reported(
    api: ApiServer, tmp_path: Path
) -> None:
    ready_pod(api, "w-0", "10.1.0.1")
    async with watching(api, tmp_path) as run:
        await run.report_where(lambda r: state(r, "w-0") is True)
        count = len(run.reports)
        api.set_annotations(NS, "w-0", {"note": "restarted"})  # nothing a host is made of
        api.set_ready(NS, "w-0", True)  # Ready again: the same
        ready_pod(api, "w-1", "10.1.0.2")
        await run.report_where(lambda r: state(r, "w-1") is True, after=count)
        assert len(run.reports) == count + 1


async def test_a_pod_running_with_its_ip_but_pending_phase_is_out_of_service(
    api: ApiServer, tmp_path: Path
) -> None:
    api.add_pod(NS, "w-0", labels=WORKER, ports=GRPC, ip="10.1.0.7", ready=True)
    async with watching(api, tmp_path) as run:
        report = await run.report_where(lambda r: len(r) == 1)
        assert state(report, "w-0") is False


async def test_only_the_selected_pods_of_the_namespace_are_reported(
    api: ApiServer, tmp_path: Path
) -> None:
    ready_pod(api, "w-0", "10.1.0.1")
    ready_pod(api, "other", "10.1.0.2", labels={"app": "other"})
    api.add_pod("elsewhere", "w-0", labels=WORKER, ports=GRPC, ip="10.2.0.1", phase="Running")
    async with watching(api, tmp_path) as run:
        report = await run.report_where(lambda r: len(r) == 1)
        assert [h.origin for h in report] == [f"kubernetes:{NS}/w-0"]
        # Labels that stop matching: the watch says DELETED; matching again: ADDED.
        count = len(run.reports)
        api.set_labels(NS, "w-0", {"app": "retired"})
        await run.report_where(lambda r: r == [], after=count)
        api.set_labels(NS, "other", WORKER)
        report = await run.report_where(lambda r: len(r) == 1, after=count)
        assert [h.origin for h in report] == [f"kubernetes:{NS}/other"]


async def test_the_namespace_given_overrides_the_kubeconfig_context(
    api: ApiServer, tmp_path: Path
) -> None:
    api.add_pod("elsewhere", "w-0", labels=WORKER, ports=GRPC, ip="10.2.0.1", phase="Running")
    async with watching(api, tmp_path, namespace="elsewhere") as run:
        report = await run.report_where(lambda r: len(r) == 1)
        assert report[0].origin == "kubernetes:elsewhere/w-0"
        assert run.source.stats.name == "kubernetes:elsewhere/app=worker"


# -- watches that expire, break or end ---------------------------------------------------


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-410"])
async def test_an_expired_watch_lists_again_and_the_hosts_stay_meanwhile(
    api: ApiServer, tmp_path: Path, fast: None, as_status: bool
) -> None:
    ready_pod(api, "w-0", "10.1.0.1")
    async with watching(api, tmp_path) as run:
        await run.report_where(lambda r: state(r, "w-0") is True)
        await until(lambda: api.open_watches == 1, what="the watch is open")
        lists, count = api.lists, len(run.reports)
        api.expire_watches(as_status=as_status)
        await until(lambda: api.lists > lists, what="a new list")
        await run.report_where(lambda r: True, after=count)  # the new list's report
        # The new watch follows what comes next.
        count = len(run.reports)
        ready_pod(api, "w-1", "10.1.0.2")
        await run.report_where(lambda r: state(r, "w-1") is True, after=count)
        assert all(state(r, "w-0") is True for r in run.reports)
        assert run.source.stats.errors == 0


async def test_a_broken_watch_reconnects_and_an_ended_one_resumes(
    api: ApiServer, tmp_path: Path, fast: None
) -> None:
    ready_pod(api, "w-0", "10.1.0.1")
    async with watching(api, tmp_path) as run:
        await run.report_where(lambda r: state(r, "w-0") is True)
        await until(lambda: api.open_watches == 1, what="the watch is open")
        lists, watches = api.lists, api.watches
        api.break_watches()  # cut mid-stream: listed again
        await until(lambda: api.lists > lists and api.open_watches == 1, what="listed, watching")
        count = len(run.reports)
        ready_pod(api, "w-1", "10.1.0.2")
        await run.report_where(lambda r: state(r, "w-1") is True, after=count)
        # Ended cleanly (a server's timeout): watched again from the last version.
        lists, watches = api.lists, api.watches
        api.end_watches()
        await until(lambda: api.watches > watches and api.open_watches == 1, what="watching again")
        count = len(run.reports)
        api.set_ready(NS, "w-1", False)
        await run.report_where(lambda r: state(r, "w-1") is False, after=count)
        assert api.lists == lists
        assert all(state(r, "w-0") is True for r in run.reports)
        assert run.source.stats.errors == 0


async def test_it_lists_again_every_resync_s_and_keeps_the_hosts(
    api: ApiServer, tmp_path: Path, fast: None
) -> None:
    ready_pod(api, "w-0", "10.1.0.1")
    async with watching(api, tmp_path, resync_s=0.1) as run:
        await until(lambda: len(run.reports) >= 4, what="four reports")
        assert api.lists >= 4
        assert all(state(r, "w-0") is True for r in run.reports)


async def test_a_long_list_is_read_in_pages(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubernetes, "LIST_PAGE", 2)
    for i in range(5):
        ready_pod(api, f"w-{i}", f"10.1.0.{i + 1}")
    async with watching(api, tmp_path) as run:
        report = await run.report_where(lambda r: len(r) == 5)
        assert api.lists == 3  # 2 + 2 + 1
        assert [h.spec.host for h in report] == [f"10.1.0.{i + 1}" for i in range(5)]


async def test_pods_past_the_bound_are_ignored_and_that_is_logged_once(
    api: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubernetes, "MAX_PODS", 3)
    for i in range(4):
        ready_pod(api, f"w-{i}", f"10.1.0.{i + 1}")
    with capture_logs() as logs:
        async with watching(api, tmp_path) as run:
            await run.report_where(lambda r: len(r) == 3)
            await until(lambda: api.open_watches == 1, what="the watch is open")
            ready_pod(api, "w-9", "10.1.0.9")  # by the watch: ignored too
            api.delete_pod(NS, "w-0")  # room for the next one
            count = len(run.reports)
            ready_pod(api, "w-8", "10.1.0.8")
            report = await run.report_where(lambda r: state(r, "w-8") is True, after=count)
    assert len(report) == 3 and state(report, "w-9") is None
    assert [e["event"] for e in logs].count("kubernetes_too_many_pods") == 1


async def test_more_hosts_than_max_hosts_are_refused_and_the_last_set_stays(
    api: ApiServer, tmp_path: Path
) -> None:
    for i in range(2):
        ready_pod(api, f"w-{i}", f"10.1.0.{i + 1}")
    with capture_logs() as logs:
        async with watching(api, tmp_path, max_hosts=2) as run:
            await run.report_where(lambda r: len(r) == 2)
            await until(lambda: api.open_watches == 1, what="the watch is open")
            ready_pod(api, "w-2", "10.1.0.3")  # a third host: the set is refused
            await until(lambda: run.source.stats.errors == 1, what="a refused set")
            ready_pod(api, "w-3", "10.1.0.4")  # a fourth: still refused, not logged again
            await until(lambda: run.source.stats.errors == 2, what="two refused sets")
            api.delete_pod(NS, "w-0")
            api.delete_pod(NS, "w-1")  # two again: reported
            report = await run.report_where(lambda r: state(r, "w-3") is True)
    assert all(len(r) <= 2 for r in run.reports)
    assert [h.origin for h in report] == [f"kubernetes:{NS}/w-2", f"kubernetes:{NS}/w-3"]
    refused = [e for e in logs if e["event"] == "discovery_too_many_hosts"]
    assert len(refused) == 1
    assert refused[0]["hosts"] == 3 and refused[0]["max_hosts"] == 2
    assert refused[0]["hosts_kept"] == 2
    assert [e["event"] for e in logs].count("discovery_recovered") == 1


# -- the server down ---------------------------------------------------------------------


async def test_the_server_down_keeps_the_last_set_counts_and_logs_once(
    api: ApiServer, tmp_path: Path, fast: None
) -> None:
    ready_pod(api, "w-0", "10.1.0.1")
    with capture_logs() as logs:
        async with watching(api, tmp_path) as run:
            await run.report_where(lambda r: state(r, "w-0") is True)
            await until(lambda: api.open_watches == 1, what="the watch is open")
            count = len(run.reports)
            await api.stop()
            await until(lambda: run.source.stats.errors >= 3, what="three failures")
            assert len(run.reports) == count  # nothing reported: the last set stands
            assert run.source.stats.hosts == 1
            assert run.source.stats.failing.startswith(f"list pods in {NS}: ConnectError")
            # Back, with a pod gone meanwhile.
            ready_pod(api, "w-1", "10.1.0.2")
            api.delete_pod(NS, "w-0")
            await api.start()
            report = await run.report_where(lambda r: state(r, "w-1") is True, after=count)
            assert state(report, "w-0") is None
            assert run.source.stats.failing == ""
    events = [e["event"] for e in logs if e["event"].startswith("discovery_")]
    assert events == ["discovery_failed", "discovery_recovered"]


async def test_a_refused_list_is_an_error_with_the_servers_words(
    api: ApiServer, tmp_path: Path, fast: None
) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    api.token = "another-token"  # the kubeconfig's is refused now
    config = KubernetesDiscovery(
        source="kubernetes", port="grpc", selector="app=worker", kubeconfig=str(kubeconfig)
    )
    run = Run(KubernetesSource(config))
    task = asyncio.ensure_future(run.source.run(run.report))
    try:
        await until(lambda: run.source.stats.errors >= 2, what="two failures")
        assert run.source.stats.failing == f"list pods in {NS}: 401 Unauthorized Unauthorized"
        assert run.reports == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_missing_credentials_are_an_error_not_a_crash(tmp_path: Path, fast: None) -> None:
    config = KubernetesDiscovery(
        source="kubernetes", port="grpc", kubeconfig=str(tmp_path / "no-such-kubeconfig")
    )
    run = Run(KubernetesSource(config))
    task = asyncio.ensure_future(run.source.run(run.report))
    try:
        await until(lambda: run.source.stats.errors >= 2, what="two failures")
        assert run.source.stats.failing.startswith("kubernetes credentials: ConfigError")
        assert run.reports == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
