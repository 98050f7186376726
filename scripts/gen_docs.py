"""Generate the reference tables of the docs from the code, so they cannot drift from it:
every configuration key (docs/configuration.md, from the pydantic schema in gateway/config)
and every metric family (docs/metrics.md, from the Prometheus registries the gateway builds).

    .venv/bin/python scripts/gen_docs.py          # rewrite the tables in place
    .venv/bin/python scripts/gen_docs.py --check  # exit 1, naming what is stale

Each table sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; the prose
around it is hand-written and left alone. tests/architecture/test_docs_current.py runs the
check. A key's meaning is its field's `description=` in gateway/config (NOT_IN_SCHEMA: the
few keys that are no field); a key without one (or an entry here for a key that no longer
exists) stops the generator: the table says what every key means.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import re
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic.fields import FieldInfo

from gateway.config import GatewayConfig, build_config
from gateway.config.discovery import ContainerPort, HostPort, PodField
from gateway.config.fields import HeaderName, ModelName
from gateway.config.loading import RENAMED
from gateway.config.observability import MetricsListen
from gateway.config.processes import MAX_PROCESSES, Processes
from gateway.config.workers import WORKER_URL_KEYS, WorkerSpec
from gateway.core.policy_names import POLICIES, PolicyName

ROOT = Path(__file__).resolve().parent.parent
END = "<!-- end generated -->"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"


def begin(tag: str) -> str:
    return f"<!-- generated: {tag} -->"


# -- configuration keys ------------------------------------------------------------------

# What each key means is its field's `description=` in gateway/config. These rows are no
# field of their own, so their meaning is told here: a worker's `url` (read into `host`,
# `port` and `tls`), the `source` tag the discovery sections share, and the old names of
# renamed sections (RENAMED: no longer in the schema, still read).
NOT_IN_SCHEMA: dict[str, str] = {
    "workers[].url": "`grpc://HOST:PORT` (`grpcs://`: TLS, see `upstream_tls`), query keys allowed",
    "discovery[].source": "which kind of source",
    "breaker": "the old name of `outlier_detection`: read for one release, with a warning",
}

# `picker.tls` is a TlsConfig too, whose descriptions are the main port's (`tls`): where
# a key means something else under `picker.tls`, its meaning there.
PICKER_TLS: dict[str, str] = {
    "picker.tls.cert": "TLS on the picker port: certificate chain (PEM; `--picker-tls-cert`); "
    "null: the main port's `tls`",
    "picker.tls.client_ca": "require Envoy's client certificate, signed by this CA (mTLS)",
}

# Whose the bound is (see the legend in docs/configuration.md). Keys not named: not a limit.
SPLIT = "replica ÷ N"  # per gateway replica; each of N serving processes gets ceil(limit / N)
SCOPE: dict[str, str] = {
    "max_attempts": "call",
    "max_message_bytes": "message",
    "picker.max_body_bytes": "call",
    "discovery[dns].max_hosts": "replica",
    "discovery[kubernetes].max_hosts": "replica",
    "discovery[file].max_hosts": "replica",
    "flow.classes[].ttl_s": "call",
    "flow.classes[].starvation_s": "call",
    "flow.queue.max_requests": f"{SPLIT}, per model",
    "flow.queue.max_bytes": f"{SPLIT}, per model",
    "flow.tenant_labels": "process",
    "tenants.<tenant>.max_inflight": SPLIT,
    "tenants.<tenant>.requests_per_minute": SPLIT,
    "tenants.<tenant>.tokens_per_minute": SPLIT,
    "models.<model>.max_inflight": f"{SPLIT}, per worker",
    "models.<model>.max_waiting": "worker report",
    "models.<model>.max_token_usage": "worker report",
    "models.<model>.vocab_size": "call",
    "migration.max_migrations": "call",
    "migration.max_resent_tokens": "call",
    "migration.max_kept_tokens": "process",
    "limits.max_choices": "call",
    "limits.max_inflight_requests": SPLIT,
    "limits.max_concurrent_streams": "connection",
    "limits.stream_idle_timeout_s": "call",
    "limits.connection_idle_timeout_s": "connection",
    "limits.max_connection_age_s": "connection",
    "limits.connection_age_grace_s": "connection",
    "limits.max_inflight_per_principal": SPLIT,
    "limits.request_read_timeout_s": "call",
    "limits.max_request_reads": SPLIT,
    "limits.max_request_reads_per_peer": SPLIT,
    "limits.max_connections": SPLIT,
    "limits.max_connections_per_peer": SPLIT,
    "limits.max_prompt_tokens": "call",
    "limits.max_completion_tokens": "call",
    "upstream.stream_window_bytes": "call",
    "upstream.max_relayed_metadata_bytes": "call",
    "upstream.max_relayed_metadata_entries": "call",
    "auth.failure_limit": "process",
    "auth.failure_window_s": "process",
    "auth.block_s": "process",
    "kv.assume_capacity": "process, per worker",
    "kv.max_ranks": "process, per worker",
    "kv.max_block_sizes": "process, per worker",
    "kv.max_blocks_per_worker": "process, per worker",
    "kv.max_blocks": "process",
    "kv.max_event_bytes": "message",
    "affinity.max_sessions": "process",
    "lora.max_loaded_per_worker": "worker report",
    "lora.max_listed_per_worker": "worker report",
    "tracing.max_queue": "process",
    "orca.max_streams": "process",
    "orca.max_streams_per_connection": "connection",
    "orca.max_streams_per_peer": "process",
    "processes": "replica",
}

# Keys with more to say than `restart` (read once at start-up): the files behind these are
# read again on SIGHUP and when they change (the key itself, a path, is read at start-up).
RELOAD: dict[str, str] = {
    "workers[]": "restart (admin API: live)",
    "tls.cert": "file: SIGHUP, change",
    "tls.key": "file: SIGHUP, change",
    "tls.client_ca": "file: SIGHUP, change",
    "picker.tls.cert": "file: SIGHUP, change",
    "picker.tls.key": "file: SIGHUP, change",
    "picker.tls.client_ca": "file: SIGHUP, change",
    "auth.api_keys_file": "file: SIGHUP, change",
    "discovery[file].path": "file: watched",
}

# Types worth a name of their own rather than their construction.
NAMED_TYPES: list[tuple[Any, str]] = [
    (PolicyName, " \\| ".join(f"`{p}`" for p in POLICIES) + " \\| a plugin's"),
    (ModelName, "model name"),
    (HeaderName, "header name"),
    (Processes, f"int 1..{MAX_PROCESSES} \\| `auto`"),
    (MetricsListen, "`HOST:PORT` \\| `off`"),
    (HostPort, "`HOST:PORT`"),
    (PodField, "`label:KEY` \\| `annotation:KEY`"),
    (ContainerPort, "port number \\| port name"),
]
MAPPING_KEYS: dict[str, str] = {"models": "<model>", "tenants": "<tenant>"}  # what a key names
TYPE_AT: dict[str, str] = {
    "listen": "`HOST:PORT`",
    "admin.listen": "`HOST:PORT`",
    "lora.adapters": "mapping: adapter id → path",
}
DEFAULT_AT: dict[str, str] = {"models.<model>.policy": "`default_policy`"}
UNIT_AT: dict[str, str] = {
    "kv.prefill_cost_per_token": "calls per token",
    "kv.balance_ratio": "ratio",
    "kv.balance_slack": "calls",
    "kv.block_size": "tokens",
    "kv.assume_capacity": "blocks",
    "probe.success_threshold": "probes",
    "probe.failure_threshold": "probes",
    "auth.failure_limit": "failures",
    "tracing.sample_ratio": "fraction",
    "models.<model>.max_token_usage": "fraction",
    "models.<model>.max_waiting": "requests",
    "models.<model>.vocab_size": "token ids",
    "flow.queue.max_requests": "calls",
    "affinity.max_sessions": "bindings",
    "lora.max_loaded_per_worker": "adapters",
    "lora.max_listed_per_worker": "adapters",
}
UNIT_BY_NAME: list[tuple[str, str]] = [  # (pattern, unit): the first that matches a key's name
    (r"_s$", "s"),
    (r"_ms$", "ms"),
    (r"_bytes$", "bytes"),
    (r"^requests_per_minute$", "requests / min"),
    (r"^tokens_per_minute$", "tokens / min"),
    (r"tokens", "tokens"),
    (r"inflight", "calls"),
    (r"streams", "streams"),
    (r"connections", "connections"),
    (r"hosts", "hosts"),
    (r"reads", "messages"),
    (r"choices", "choices"),
    (r"ranks", "ranks"),
    (r"block_sizes", "sizes"),
    (r"blocks", "blocks"),
    (r"threshold", "calls"),
    (r"attempts", "attempts"),
    (r"migrations", "continuations"),
    (r"entries", "entries"),
    (r"^max_queue$|^batch_size$", "spans"),
    (r"tenant_labels", "tenants"),
]


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of the configuration table."""

    path: str
    type: str
    default: str
    unit: str
    reload: str
    scope: str
    meaning: str


ABSENT = object()  # the default of a section that is off unless given


@dataclasses.dataclass(frozen=True)
class _Found:
    path: str
    hint: Any
    default: Any
    meaning: str | None  # None: nobody said (the generator stops)


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _strip(hint: Any) -> tuple[Any, bool]:
    """The type without `| None` (and without Annotated around a section); whether it was
    optional."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
    if typing.get_origin(hint) is Annotated and _is_section(typing.get_args(hint)[0]):
        hint = typing.get_args(hint)[0]
    return hint, optional


def _default(info: FieldInfo) -> Any:
    """A field's default as pydantic has it (a `Field(default=...)` is no plain dataclass
    default), a factory's called; MISSING: required."""
    if info.is_required():
        return dataclasses.MISSING
    return info.get_default(call_default_factory=True, validated_data={})


def _fields(cls: type, prefix: str, skip: Sequence[str] = ()) -> Iterator[_Found]:
    """The keys of a section: each field's, with the field's `description` as meaning."""
    hints = typing.get_type_hints(cls, include_extras=True)
    infos: Mapping[str, FieldInfo] = getattr(cls, "__pydantic_fields__")  # noqa: B009
    for field in dataclasses.fields(cls):
        if field.name not in skip:
            info = infos[field.name]
            path = f"{prefix}{field.name}"
            yield from _walk(path, hints[field.name], _default(info), info.description)


def _sources(hint: Any) -> tuple[type, ...]:
    """The sections of a tagged union (`Annotated[A | B, Field(discriminator=...)]`)."""
    if typing.get_origin(hint) is not Annotated:
        return ()
    members = typing.get_args(typing.get_args(hint)[0])
    return members if members and all(_is_section(m) for m in members) else ()


def _walk(path: str, hint: Any, default: Any, meaning: str | None) -> Iterator[_Found]:
    """Every key under `path`: a section's keys, a list's entries, a mapping's values.
    `meaning`: the field's description, for the row of `path` itself."""
    inner, optional = _strip(hint)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if _is_section(inner):
        if optional:  # a section that is off unless given (flow:)
            yield _Found(path, "section", ABSENT, meaning)
        yield from _fields(inner, f"{path}.")
    elif origin is tuple and _strip(args[0])[0] is WorkerSpec:
        yield _Found(path + "[]", "worker URL \\| mapping", default, meaning)
        yield _unlike_schema(path + "[].url", str, dataclasses.MISSING)
        kept = [f.name for f in dataclasses.fields(WorkerSpec) if f.name not in WORKER_URL_KEYS]
        yield from _fields(WorkerSpec, f"{path}[].", skip=kept)
    elif origin is tuple and _sources(args[0]):  # discovery sources
        sources = _sources(args[0])
        tags = [typing.get_args(typing.get_type_hints(s)["source"])[0] for s in sources]
        yield _Found(path + "[]", "list", default, meaning)
        yield _unlike_schema(path + "[].source", Literal[tuple(tags)], dataclasses.MISSING)
        for source, tag in zip(sources, tags, strict=True):
            yield from _fields(source, f"{path}[{tag}].", skip=("source",))
    elif origin is tuple and _is_section(args[0]):  # flow.classes
        yield _Found(path, "list of mappings", default, meaning)
        yield from _fields(args[0], f"{path}[].")
    elif origin is Mapping:
        yield _Found(path, "mapping", default, meaning)
        yield from _fields(args[1], f"{path}.{MAPPING_KEYS[path]}.")
    else:
        yield _Found(path, hint, default, PICKER_TLS.get(path, meaning))


def _unlike_schema(path: str, hint: Any, default: Any) -> _Found:
    """A key that is no field of the schema: its meaning from NOT_IN_SCHEMA."""
    return _Found(path, hint, default, NOT_IN_SCHEMA.get(path))


def _bound(meta: Sequence[Any]) -> str:
    """`≥ 1`, `> 0`, `0..1`, `non-empty` from pydantic's Field and annotated-types."""
    found: dict[str, Any] = {}
    for item in meta:
        for each in getattr(item, "metadata", [item]):
            for attr in ("ge", "gt", "le", "lt", "min_length"):
                if getattr(each, attr, None) is not None:
                    found[attr] = getattr(each, attr)
    if "ge" in found and "le" in found:
        return f"{found['ge']}..{found['le']}"
    parts = [f"{sign} {found[attr]}" for attr, sign in (("ge", "≥"), ("gt", ">")) if attr in found]
    parts += [f"{sign} {found[attr]}" for attr, sign in (("le", "≤"), ("lt", "<")) if attr in found]
    if found.get("min_length"):
        parts.append("(non-empty)")
    return ", ".join(parts)


def render_type(hint: Any) -> str:
    if isinstance(hint, str):
        return hint
    for named, text in NAMED_TYPES:
        if hint == named:
            return text
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        base, bound = render_type(args[0]), _bound(args[1:])
        return f"{base} {bound}" if bound else base
    if origin in (typing.Union, types.UnionType):
        shown = [render_type(a) for a in args if a is not type(None)]
        return " \\| ".join(shown) + (" \\| null" if type(None) in args else "")
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is tuple:
        return f"list of {render_type(args[0])}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in hint)
    names = {bool: "bool", int: "int", float: "number", str: "string"}
    if hint in names:
        return names[hint]
    raise ValueError(f"no rendering for the type {hint!r}: add it to NAMED_TYPES")


def render_default(value: Any, unit: str) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if value is ABSENT:
        return "absent"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        if unit == "bytes" and value >= 1024:
            size = value / 1024**2 if value >= 1024**2 else value / 1024
            return f"{value} ({size:g} {'MiB' if value >= 1024**2 else 'KiB'})"
        return str(value)
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return ", ".join(_entry(v) for v in value)  # flow.classes
    if isinstance(value, tuple):
        return ", ".join(f"`{v}`" for v in value) if value else "`[]`"
    if isinstance(value, Mapping) and not value:
        return "`{}`"
    return str(value)


def _entry(value: Any) -> str:
    """A default list entry: `name` (its other fields that are set)."""
    fields = dataclasses.asdict(value)
    rest = [f"{k} {render_default(v, '')}" for k, v in fields.items() if k != "name" and v]
    return f"`{fields['name']}` ({', '.join(rest)})"


def unit_of(path: str) -> str:
    if path in UNIT_AT:
        return UNIT_AT[path]
    name = path.rpartition(".")[2]
    return next((unit for pattern, unit in UNIT_BY_NAME if re.search(pattern, name)), "")


def config_keys() -> list[Key]:
    """Every key `GatewayConfig` takes, with its renamed sections, in the schema's order."""
    found = list(_fields(GatewayConfig, ""))
    found += [_unlike_schema(old, f"section (= `{new}`)", ABSENT) for old, new in RENAMED.items()]
    paths = [f.path for f in found]
    undescribed = [f.path for f in found if not f.meaning]
    gone = [p for p in (*NOT_IN_SCHEMA, *PICKER_TLS, *SCOPE, *RELOAD) if p not in paths]
    if undescribed or gone:
        raise SystemExit(
            "scripts/gen_docs.py: "
            + (
                f"keys without a meaning (give the field a `description=` in gateway/config; "
                f"NOT_IN_SCHEMA is for keys that are no field): {undescribed}; "
                if undescribed
                else ""
            )
            + (f"entries for keys that no longer exist: {sorted(set(gone))}" if gone else "")
        )
    keys = []
    for f in found:
        unit = unit_of(f.path) if not isinstance(f.hint, str) else ""
        keys.append(
            Key(
                path=f.path,
                type=TYPE_AT.get(f.path) or render_type(f.hint),
                default=DEFAULT_AT.get(f.path) or render_default(f.default, unit),
                unit=unit,
                reload=RELOAD.get(f.path, "restart"),
                scope=SCOPE.get(f.path, ""),
                meaning=f.meaning or "",
            )
        )
    return keys


def config_table() -> str:
    return _table(
        ("key", "type", "default", "unit", "takes effect", "scope", "meaning"),
        (
            (f"`{k.path}`", k.type, k.default, k.unit, k.reload, k.scope, k.meaning)
            for k in config_keys()
        ),
    )


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table, one line a row."""
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines) + "\n"


# -- metrics -----------------------------------------------------------------------------

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
    return _table(
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


# -- the generated blocks in their docs --------------------------------------------------

BLOCKS: dict[str, tuple[Path, Callable[[], str]]] = {
    "config": (CONFIG_DOC, config_table),
    "metrics": (METRICS_DOC, metrics_table),
}


def block(text: str, tag: str) -> str | None:
    """The generated block `tag` of a doc, between its markers (None: no markers)."""
    start, end = text.find(begin(tag)), text.find(END, text.find(begin(tag)))
    if start < 0 or end < 0:
        return None
    return text[start + len(begin(tag)) : end].strip("\n") + "\n"


def with_block(text: str, tag: str, body: str) -> str:
    start = text.index(begin(tag)) + len(begin(tag))
    return text[:start] + "\n" + body + text[text.index(END, start) :]


def _rows(body: str) -> dict[str, str]:
    """A table's rows by their first cell (the key or metric)."""
    rows = {}
    for line in body.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) > 1:
            rows[cells[0].removeprefix("| ")] = line
    return rows


def stale(tag: str, doc: str, fresh: str) -> list[str]:
    """What is out of date in the doc text's block `tag`, against a fresh rendering: rows
    missing, rows for what no longer exists, rows that changed."""
    committed = block(doc, tag)
    if committed is None:
        return [f"{tag}: no `{begin(tag)}` ... `{END}` block"]
    if committed == fresh:
        return []
    have, want = _rows(committed), _rows(fresh)
    problems = [f"{tag}: missing row {name}" for name in want if name not in have]
    problems += [
        f"{tag}: row for {name}, which no longer exists" for name in have if name not in want
    ]
    problems += [
        f"{tag}: row {name} differs" for name in want if name in have and have[name] != want[name]
    ]
    return problems or [f"{tag}: the table differs (header or order)"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    problems = []
    for tag, (path, render) in BLOCKS.items():
        text, fresh = path.read_text(), render()
        if args.check:
            problems += stale(tag, text, fresh)
        elif block(text, tag) != fresh:
            path.write_text(with_block(text, tag, fresh))
            print(f"rewrote the {tag} table in {path.relative_to(ROOT)}")
    for problem in problems:
        print(problem)
    if problems:
        print("regenerate with `.venv/bin/python scripts/gen_docs.py`")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
