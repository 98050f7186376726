"""The metrics table of docs/metrics.md: every metric family the gateway registers, read
from gateways built and started in this process (one build per set of families) and
from the supervisor's registry."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.config import build_config
from scripts.docs_gen.blocks import markdown_table

# How the gateway is built for each set of metric families, in order: a family is listed
# with the first build that has it. (name, when, config): serving processes are started as
# `gateway serve` starts one; the supervisor's registry is that of `--processes N`.
BUILDS: list[tuple[str, Mapping[str, Any]]] = [
    ("always", {}),
    ("with `flow:`", {"flow": {}}),
    ("with `affinity.header`", {"affinity": {"header": "x-session-id"}}),
    ("with `lora.adapters`", {"lora": {"adapters": {"sql-lora": "/models/loras/sql"}}}),
    ("with tracing on", {"tracing": {"endpoint": "http://127.0.0.1:4317"}}),
    ("with `discovery:`", {"discovery": [{"source": "file", "path": "{workers}"}]}),
    ("with `state.url`", {"state": {"url": "redis://127.0.0.1:1/0"}}),
]
SUPERVISOR = "`--processes N` (the supervisor's)"
QUIET = {"listen": "127.0.0.1:0", "admin": {"listen": "127.0.0.1:0"}, "metrics": {"listen": "off"}}


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the metrics table: a metric as /metrics exposes it."""

    name: str
    type: str
    labels: tuple[str, ...]
    meaning: str
    present: str


def _exposed(name: str, kind: str) -> str:
    return {"counter": f"{name}_total", "info": f"{name}_info"}.get(kind, name)


def _families(registry: Any, present: str) -> list[Family]:
    """The registry's families, with their label names: declared by the metric objects
    (a labelled counter with no child yet has no sample), by the collectors' families, and
    seen on samples."""
    declared: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):
        name = getattr(collector, "_name", None)
        if name is not None:
            declared[name] = tuple(getattr(collector, "_labelnames", ()))
    found = []
    for family in registry.collect():
        labels = list(declared.get(family.name, getattr(family, "_labelnames", ())))
        for sample in family.samples:
            labels += [k for k in sample.labels if k not in labels and k not in ("le", "quantile")]
        doc = " ".join(family.documentation.split()).replace("|", "\\|")
        name = _exposed(family.name, family.type)
        found.append(Family(name, family.type, tuple(labels), doc, present))
    return found


async def _serving(data: Mapping[str, Any]) -> list[Family]:
    """A serving process's families: started (so every collector it registers while
    starting is in), read, stopped."""
    from gateway.app.server import Gateway

    gateway = Gateway(build_config({**data, **QUIET}))
    try:
        await gateway.start()
        return _families(gateway.parts.metrics.prometheus, "")
    finally:
        await gateway.close()


def _supervisor(data: Mapping[str, Any]) -> list[Family]:
    from gateway.scale.supervisor import Supervisor

    config = build_config({**data, **QUIET, "processes": 2})
    return _families(Supervisor(config).prometheus_registry(), SUPERVISOR)


async def _all_families() -> list[Family]:
    seen: dict[str, Family] = {}
    with tempfile.TemporaryDirectory(prefix="gen-docs-") as scratch:
        workers = Path(scratch) / "workers.yaml"
        workers.write_text("[]\n")
        every: dict[str, Any] = {}
        for present, data in BUILDS:
            filled = _filled(data, str(workers))
            every.update(filled)
            for family in await _serving(filled):
                seen.setdefault(family.name, dataclasses.replace(family, present=present))
        for family in _supervisor(every):
            seen.setdefault(family.name, family)
    return sorted(seen.values(), key=lambda f: f.name)


def _filled(data: Mapping[str, Any], workers: str) -> dict[str, Any]:
    if "discovery" not in data:
        return dict(data)
    return {"discovery": [{**d, "path": workers} for d in data["discovery"]]}


def metric_families() -> list[Family]:
    import logging

    import structlog

    # The serving processes started here log as they start and stop: nothing to show.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    return asyncio.run(_all_families())


def metrics_table() -> str:
    return markdown_table(
        ("metric", "type", "labels", "meaning", "present"),
        (
            (
                f"`{f.name}`",
                f.type,
                ", ".join(f"`{label}`" for label in f.labels),
                f.meaning,
                f.present,
            )
            for f in metric_families()
        ),
    )
