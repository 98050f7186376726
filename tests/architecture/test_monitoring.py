"""The shipped monitoring (deploy/monitoring): the Prometheus rules pass `promtool check
rules` and their unit tests (`promtool test rules`), and every series the rules and the
Grafana dashboard name is one the gateway exports (the metrics reference, which
test_docs_current keeps equal to what the gateway builds)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
SERIES = re.compile(r"\b((?:gateway|process)_[a-z0-9_]+)")
SUFFIXES = ("_bucket", "_count", "_sum")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: apt install prometheus (.ci/run does)")
    return found


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=MONITORING, capture_output=True, text=True, timeout=60
    )


def test_the_rules_are_valid() -> None:
    checked = run("check", "rules", "rules.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_rules_unit_tests_pass() -> None:
    tested = run("test", "rules", "rules.test.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def exported() -> set[str]:
    """Every family of the metrics reference, as /metrics names its samples."""
    table = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `([a-z_:0-9]+)`", table, re.MULTILINE))


def expressions() -> Iterator[tuple[str, str]]:
    rules = yaml.safe_load((MONITORING / "rules.yaml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield rule.get("record") or rule["alert"], rule["expr"]
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["name"], variable["definition"]


def family(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def test_every_series_named_is_exported() -> None:
    known = exported()
    assert "gateway_requests_total" in known
    unknown = {
        (where, series)
        for where, expr in expressions()
        for series in SERIES.findall(expr)
        if family(series) not in known
    }
    assert not unknown, sorted(unknown)


def test_the_dashboard_uses_a_datasource_variable_and_unique_panel_ids() -> None:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    sources = {
        target["datasource"]["uid"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
    }
    assert sources == {"${datasource}"}  # no data source of ours baked in
