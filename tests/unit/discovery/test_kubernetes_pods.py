"""What the Kubernetes source makes of a pod, against the stand-in API server
(tests/support/fakes/apiserver.py): the model from a label or an annotation, the bootstrap
port from an annotation, the container port by name or number, an IPv6 address, and bad pod
data skipped with one log line per problem."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from tests.support import kubernetes_source
from tests.support.fakes.apiserver import ApiServer
from tests.support.kubernetes_source import NS, WORKER, host, ready_pod, state, watching
from tests.support.waits import until

api = kubernetes_source.api  # the fixture (tests/support/kubernetes_source.py)
fast = kubernetes_source.fast  # the fixture (tests/support/kubernetes_source.py)


# -- what a pod says ---------------------------------------------------------------------


async def test_the_model_from_a_label_or_an_annotation(api: ApiServer, tmp_path: Path) -> None:
    ready_pod(api, "w-0", "10.1.0.1", labels={**WORKER, "model": "qwen2.5-7b"})
    ready_pod(api, "w-1", "10.1.0.2", annotations={"gateway/model": "meta-llama/Llama-3-8B"})
    async with watching(api, tmp_path, model=None, model_from="label:model") as run:
        report = await run.report_where(lambda r: len(r) == 1)  # w-1 has no such label
        assert host(report, "w-0").spec.model == "qwen2.5-7b"
    async with watching(api, tmp_path, model=None, model_from="annotation:gateway/model") as run:
        report = await run.report_where(lambda r: len(r) == 1)
        assert host(report, "w-1").spec.model == "meta-llama/Llama-3-8B"
    async with watching(api, tmp_path, model=None) as run:
        report = await run.report_where(lambda r: len(r) == 2)
        assert {h.spec.model for h in report} == {None}  # asked from each worker


async def test_the_bootstrap_port_from_an_annotation(api: ApiServer, tmp_path: Path) -> None:
    annotation = "gateway.example/bootstrap-port"
    ready_pod(api, "p-0", "10.1.0.1", annotations={annotation: "8998"})
    ready_pod(api, "p-1", "10.1.0.2")  # none: the worker's default
    settings = {"role": "prefill", "runtime": "sglang", "bootstrap_port_annotation": annotation}
    async with watching(api, tmp_path, **settings) as run:
        report = await run.report_where(lambda r: len(r) == 2)
    p0, p1 = host(report, "p-0").spec, host(report, "p-1").spec
    assert (p0.bootstrap_port, p0.role, p0.runtime) == (8998, "prefill", "sglang")
    assert p1.bootstrap_port is None


async def test_the_container_port_by_name_or_by_number(api: ApiServer, tmp_path: Path) -> None:
    ready_pod(api, "w-0", "10.1.0.1", ports={"metrics": 9100, "grpc": 30000})
    ready_pod(api, "w-1", "10.1.0.2", ports={"http": 8080})
    with capture_logs() as logs:
        async with watching(api, tmp_path, port="grpc") as run:
            report = await run.report_where(lambda r: len(r) == 1)
            assert host(report, "w-0").spec.port == 30000
    assert [(e["event"], e["pod"], e["problem"]) for e in logs if "pod" in e] == [
        ("kubernetes_pod_skipped", f"{NS}/w-1", "no container port named 'grpc'")
    ]
    for port in (50051, "50051"):
        async with watching(api, tmp_path, port=port) as run:
            report = await run.report_where(lambda r: len(r) == 2)
            assert {h.spec.port for h in report} == {50051}


async def test_an_ipv6_pod_address(api: ApiServer, tmp_path: Path) -> None:
    ready_pod(api, "w-0", "fd00::7")
    async with watching(api, tmp_path) as run:
        report = await run.report_where(lambda r: len(r) == 1)
        assert report[0].spec.address == "[fd00::7]:9000"


async def test_bad_pod_data_skips_the_pod_and_is_logged_once_per_problem(
    api: ApiServer, tmp_path: Path, fast: None
) -> None:
    annotation = "bootstrap-port"
    ready_pod(api, "good", "10.1.0.1", labels={**WORKER, "model": "m"})
    ready_pod(api, "bad-model", "10.1.0.2", labels={**WORKER, "model": "not a model!"})
    ready_pod(api, "bad-port", "10.1.0.3", labels={**WORKER, "model": "m"})
    api.set_annotations(NS, "bad-port", {annotation: "eighty"})
    ready_pod(api, "bad-ip", "10.1.0.300", labels={**WORKER, "model": "m"})
    settings = {"model": None, "model_from": "label:model", "bootstrap_port_annotation": annotation}
    with capture_logs() as logs:
        async with watching(api, tmp_path, resync_s=0.2, **settings) as run:
            await run.report_where(lambda r: [h.origin for h in r] == [f"kubernetes:{NS}/good"])
            # Changed, listed again: still the same problems, not logged again.
            lists = api.lists
            api.set_ready(NS, "bad-model", False)
            api.set_ready(NS, "bad-port", False)
            await until(lambda: api.lists >= lists + 2, what="two more lists")
            # Another problem is logged; a mended pod comes in.
            count = len(run.reports)
            api.set_annotations(NS, "bad-port", {annotation: "70000"})
            api.set_labels(NS, "bad-model", {**WORKER, "model": "good-model"})
            report = await run.report_where(lambda r: state(r, "bad-model") is False, after=count)
    assert host(report, "bad-model").spec.model == "good-model"
    skipped = [(e["pod"], e["problem"]) for e in logs if e["event"] == "kubernetes_pod_skipped"]
    assert skipped == [  # the list's pods in name order, then the watch's
        (f"{NS}/bad-ip", "pod IP '10.1.0.300' is not an address"),
        (
            f"{NS}/bad-model",
            "model: model name 'not a model!' has characters other than letters, digits and"
            " . _ : / @ + -",
        ),
        (f"{NS}/bad-port", "annotation bootstrap-port 'eighty' is not a port number"),
        (f"{NS}/bad-port", "annotation bootstrap-port '70000' is not a port number"),
    ]
    assert run.source.stats.errors == 0
