"""Generate the reference tables of the docs from the code, so they cannot drift from it:
every configuration key (docs/configuration.md, from the pydantic schema in gateway/config)
and every metric family (docs/metrics.md, from the Prometheus registries the gateway builds).

    .venv/bin/python scripts/gen_docs.py          # rewrite the tables in place
    .venv/bin/python scripts/gen_docs.py --check  # exit 1, naming what is stale

Each table sits between `<!-- generated: NAME -->` and `<!-- end generated -->`; the prose
around it is hand-written and left alone. tests/architecture/test_docs_current.py runs the
check. A key without a line in MEANING (or a line for a key that no longer exists) stops
the generator: the table says what every key means.
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

# What each key means, by its dotted path (`<model>`, `<tenant>`: any name; `[]`: every
# entry of a list; `discovery[dns]`: an entry of that source).
MEANING: dict[str, str] = {
    "listen": "the main port: engine services, health, ORCA, reflection",
    "workers[]": "static workers: a worker URL, or a mapping with `url` and the URL's query keys",
    "workers[].url": "`grpc://HOST:PORT` (`grpcs://`: TLS, see `upstream_tls`), query keys allowed",
    "workers[].model": "the model it serves; absent: asked from the worker (`GetModelInfo`)",
    "workers[].runtime": "its engine protocol; absent: detected from the services it serves",
    "workers[].role": "absent: regular, or asked from the worker when model or runtime are",
    "workers[].bootstrap_host": "SGLang prefill: the host decode workers fetch KV from "
    "(default: the URL's host)",
    "workers[].bootstrap_port": "SGLang prefill: its bootstrap port (else asked; else 8998)",
    "workers[].embedding_port": "EPD prefill: the port encoders push embeddings to",
    "discovery[]": "sources of workers, each a mapping with `source`",
    "discovery[].source": "which kind of source",
    "discovery[dns].name": "the name to resolve",
    "discovery[dns].port": "the workers' port, with A/AAAA records; absent: SRV records",
    "discovery[dns].nameserver": "the resolver to ask; null: the system's",
    "discovery[dns].interval_s": "resolve again this often (sooner when the records' TTL is "
    "shorter)",
    "discovery[dns].model": "as a URL's `model`; null: asked from each worker",
    "discovery[dns].runtime": "as a URL's `runtime`",
    "discovery[dns].role": "as a URL's `role`",
    "discovery[dns].tls": "reach the workers over TLS (`grpcs://`, with `upstream_tls`)",
    "discovery[dns].max_hosts": "a larger answer is refused whole; the last hosts stay",
    "discovery[kubernetes].port": "the Pods' container port, by name or number",
    "discovery[kubernetes].selector": "label selector of the Pods; empty: every Pod",
    "discovery[kubernetes].namespace": "null: the pod's own (in cluster), else kubeconfig's",
    "discovery[kubernetes].model": "as a URL's `model` (or `model_from`)",
    "discovery[kubernetes].model_from": "the model from a Pod label or annotation",
    "discovery[kubernetes].runtime": "as a URL's `runtime`",
    "discovery[kubernetes].role": "as a URL's `role`",
    "discovery[kubernetes].tls": "reach the Pods over TLS (`grpcs://`)",
    "discovery[kubernetes].bootstrap_port_annotation": "SGLang PD: the annotation holding a "
    "prefill's bootstrap port",
    "discovery[kubernetes].unready_grace_s": "a Pod out of service this long leaves the fleet",
    "discovery[kubernetes].resync_s": "list the Pods again this often, whatever the watch said",
    "discovery[kubernetes].kubeconfig": "null: in-cluster credentials, else $KUBECONFIG or "
    "~/.kube/config",
    "discovery[kubernetes].max_hosts": "a larger set of Pods is refused whole; the last stay",
    "discovery[file].path": "a YAML list of worker URLs (or `workers:` entries)",
    "discovery[file].interval_s": "how often the file is checked for a change",
    "discovery[file].max_hosts": "more entries (or over 256 bytes an entry) are refused",
    "flow": "flow control: calls wait in per-model queues instead of WORKERS_OVERLOADED; "
    "absent: off",
    "flow.classes": "priority classes, highest first",
    "flow.classes[].name": "the class's name, as clients ask for it",
    "flow.classes[].ttl_s": "a call waits at most this long: then QUEUE_TIMEOUT",
    "flow.classes[].starvation_s": "waited this long: served next, ahead of every class",
    "flow.default_class": "the class of a call that names none (or an unknown one)",
    "flow.priority_header": "the request header naming a call's class",
    "flow.queue.max_requests": "calls waiting per model; past it: QUEUE_FULL",
    "flow.queue.max_bytes": "bytes of waiting requests per model; past it: QUEUE_FULL",
    "flow.trust_tenant_header": "true: `tenant_header` names the tenant (behind a trusted "
    "proxy only)",
    "flow.tenant_header": "the request header naming the tenant, when trusted",
    "flow.cost_tokens": "a call's output when it sets no max new tokens (its cost, its charge)",
    "flow.tenant_labels": "tenants named in per-tenant metrics at once; the rest `other`",
    "tenants": "per tenant (principal name; `default`: every other tenant)",
    "tenants.<tenant>.max_class": "the highest class it may ask for; null: any",
    "tenants.<tenant>.weight": "its share within a class, against other tenants",
    "tenants.<tenant>.max_inflight": "its calls in flight; past it, its calls wait (with "
    "`flow:` only)",
    "tenants.<tenant>.requests_per_minute": "token bucket of calls; past it: RATE_LIMITED",
    "tenants.<tenant>.tokens_per_minute": "token bucket of prompt + generated tokens; past "
    "it: RATE_LIMITED",
    "models": "per-model settings",
    "models.<model>.policy": "the model's placement policy",
    "models.<model>.encode_leg": "multimodal calls need the encode leg even with no encoder up",
    "models.<model>.max_inflight": "calls the gateway runs at once on one worker of the model",
    "models.<model>.max_waiting": "a worker reporting more waiting requests takes no more calls",
    "models.<model>.max_token_usage": "a worker reporting more KV usage takes no more calls",
    "models.<model>.route": "makes the name an alias: each call goes to one of these "
    "models by weight (see docs/routing.md, model aliases)",
    "models.<model>.route[].model": "a target: a model the config names, or an alias one "
    "level deep",
    "models.<model>.route[].weight": "its share of the calls (at least one above 0)",
    "models.<model>.vocab_size": "prompt token ids must be below it, else INVALID_ARGUMENT "
    "(default: the smallest vocabulary its workers report)",
    "default_policy": "the policy of models without one",
    "model_headers": "request headers naming the model; the first one present wins",
    "routing_key_header": "the `consistent_hash` key",
    "target_worker_header": "`HOST:PORT`: the worker for `manual` and fleet-wide RPCs",
    "max_attempts": "upstream attempts per call (retries before the first message)",
    "retry_after_ms": "RetryInfo / `retry-after` / pushback of retryable verdicts",
    "discovery_timeout_s": "start-up waits at most this long for workers and sources",
    "max_message_bytes": "largest request or response message, on every port and channel",
    "log_format": "console lines for people, JSON lines for machines",
    "log_level": "the lowest level logged",
    "probe.interval_s": "grpc.health probe of every worker this often",
    "probe.timeout_s": "a probe's deadline",
    "probe.success_threshold": "good probes in a row that bring a worker back",
    "probe.failure_threshold": "failed probes in a row (timeouts, errors) that take it out",
    "outlier_detection.failure_threshold": "failed calls in a row that eject a worker",
    "outlier_detection.cooldown_s": "ejected this long, then one trial call at a time",
    "outlier_detection.success_threshold": "trial successes in a row that bring it back",
    "breaker": "the old name of `outlier_detection`: read for one release, with a warning",
    "loads.interval_s": "`GetLoads` poll of every worker this often (a report is trusted "
    "for 3 intervals)",
    "loads.timeout_s": "a poll's deadline",
    "drain.delay_s": "on SIGTERM: NOT_SERVING, serving on for this long",
    "drain.grace_s": "then in-flight calls get this long to finish",
    "drain.worker_timeout_s": "bounds the drain of one worker removed (admin, discovery)",
    "disagg.abort_wait_s": "an abort or cancel waits this long for a decode leg's first message",
    "disagg.decode_first_message_timeout_s": "a decode leg with no first message this long "
    "after it was called is given up and the call placed again (before any byte reached "
    "the client); 0: no bound",
    "migration.enabled": "a stream whose worker fails after tokens went goes on elsewhere",
    "migration.max_migrations": "continuations per call (per choice of a split n > 1)",
    "migration.max_resent_tokens": "the longest prompt + relayed tokens a continuation re-sends",
    "migration.max_kept_tokens": "relayed token ids kept for all streams (~3 bytes each); "
    "streams past it are not followed",
    "limits.max_choices": "most `sampling_params.n`; past it: REQUEST_OVER_LIMIT",
    "limits.max_inflight_requests": "calls in flight at once; past it: GATEWAY_OVERLOADED",
    "limits.max_concurrent_streams": "streams per client connection (HTTP/2 SETTINGS)",
    "limits.stream_idle_timeout_s": "a stream on which nothing moved this long is ended; 0: off",
    "limits.connection_idle_timeout_s": "a connection with no call this long is closed; 0: off",
    "limits.max_connection_age_s": "every connection is asked to go away after this; 0: off",
    "limits.connection_age_grace_s": "then its calls get this long to finish",
    "limits.max_inflight_per_principal": "one caller's calls in flight (null: a quarter of "
    "`max_inflight_requests`); past it: CALLER_OVER_SHARE",
    "limits.request_read_timeout_s": "from a stream's opening to its complete request",
    "limits.max_request_reads": "request messages read at once; the rest wait their turn",
    "limits.max_request_reads_per_peer": "request messages one caller has read at once",
    "limits.max_connections": "client connections at once; grpc core closes the ones past it",
    "limits.max_connections_per_peer": "one client address's connections; the newest past it "
    "are closed",
    "limits.max_prompt_tokens": "longest `tokenized.input_ids`; past it: REQUEST_OVER_LIMIT",
    "limits.max_completion_tokens": "what a choice with no max new tokens is believed to "
    "generate at most",
    "upstream.keepalive_time_s": "HTTP/2 ping on a silent worker connection this often; 0: off",
    "upstream.keepalive_timeout_s": "an unanswered ping closes the connection after this",
    "upstream.stream_window_bytes": "what a worker may send ahead on one stream (HTTP/2 window)",
    "upstream.max_relayed_metadata_bytes": "a worker's headers, and its trailers, relayed up "
    "to this size",
    "upstream.max_relayed_metadata_entries": "... and up to this many entries",
    "tls.cert": "TLS on the main port: certificate chain (PEM)",
    "tls.key": "its private key (PEM)",
    "tls.client_ca": "require client certificates this CA signed (mTLS)",
    "upstream_tls.ca": "verifies `grpcs://` workers; null: the system roots",
    "upstream_tls.cert": "the gateway's client certificate, where workers require mTLS",
    "upstream_tls.key": "its private key",
    "auth.api_keys_file": "`name:key` lines; set: every call needs `authorization: Bearer KEY`",
    "auth.failure_limit": "failed authentications from one address that block it; 0: off",
    "auth.failure_window_s": "... counted within this window",
    "auth.block_s": "a blocked address is refused this long, correct key or not",
    "kv.events": "follow every worker's `SubscribeKvEvents` into the prefix index",
    "kv.block_size": "block size for workers that report none",
    "kv.prefill_cost_per_token": "weight of one uncached prompt token against one queued call",
    "kv.balance_ratio": "balance guard: load and share at most this times the least / mean",
    "kv.balance_slack": "balance guard: plus this much load",
    "kv.share_window_s": "placement shares decay over this window",
    "kv.assume_ttl_s": "workers without KV events: a placement assumed cached this long",
    "kv.assume_capacity": "... at most this many blocks a worker",
    "kv.pending_ttl_s": "workers with KV events: a placement remembered this long",
    "kv.grace_s": "a worker not ready this long loses its index entries",
    "kv.max_ranks": "data-parallel ranks indexed per worker",
    "kv.max_block_sizes": "distinct block sizes indexed per worker",
    "kv.max_blocks_per_worker": "stored blocks indexed per worker (~200 bytes each)",
    "kv.max_blocks": "stored blocks indexed in all: the index's memory bound",
    "kv.max_event_bytes": "largest KV event message; a bigger one restarts the subscription",
    "kv.resubscribe_max_s": "a failing subscription's backoff grows to this",
    "affinity.header": "request header naming a call's session; null: affinity off",
    "affinity.ttl_s": "a session's binding unused this long is forgotten",
    "affinity.max_sessions": "bindings (session, model, leg) kept; the least recently used go",
    "lora.adapters": "LoRA adapter id -> its path on the workers (SGLang); empty: adapters "
    "are only preferred where held, never loaded or refused",
    "lora.max_loaded_per_worker": "adapters one worker may hold before the gateway unloads "
    "its least recently used unused one",
    "lora.load_on_demand": "load a call's adapter on the chosen worker when it lacks it",
    "lora.load_timeout_s": "bound on one on-demand load (and the unload before it)",
    "lora.max_listed_per_worker": "adapters read of one worker's list; the rest are ignored "
    "(counted as a rejected load figure)",
    "admin.listen": "the admin API's port (non-loopback needs a token)",
    "admin.token": "bearer token the admin API requires",
    "metrics.listen": "Prometheus `/metrics` endpoint; `off`: none",
    "tracing.endpoint": "OTLP/gRPC collector; null: `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`, "
    "else tracing off",
    "tracing.insecure": "plaintext to the collector; null: from the endpoint's scheme",
    "tracing.sample_ratio": "parent-based ratio; null: `OTEL_TRACES_SAMPLER(_ARG)`, else all",
    "tracing.service_name": "null: `OTEL_SERVICE_NAME`, else `model-gateway`",
    "tracing.max_queue": "spans waiting for export; past it the oldest are dropped",
    "tracing.batch_size": "spans per export",
    "tracing.schedule_delay_ms": "export at least this often",
    "tracing.export_timeout_s": "an export's deadline",
    "orca.trailers": "end every engine call's trailers with `endpoint-load-metrics-bin`",
    "orca.min_interval_s": "shortest interval a `StreamCoreMetrics` stream gets",
    "orca.max_streams": "`StreamCoreMetrics` streams at once",
    "orca.max_streams_per_connection": "... on one client connection",
    "orca.max_streams_per_peer": "... of one principal or address (null: `max_streams` / 4)",
    "picker.listen": "the endpoint picker's port (Envoy's ext_proc, `--picker-listen`); null: off",
    "picker.relay_address": "`IP:PORT` Envoy sends the relay's calls to "
    "(`--picker-relay-address`); null: the main `listen` (a wildcard host as 127.0.0.1)",
    "picker.header": "the request header the picker names each call's destination in",
    "picker.migrate_streams": "streamed Generates go to the relay too, so they can migrate",
    "picker.max_body_bytes": "the most of a request body the picker reads; a longer "
    "one goes to the relay",
    "picker.trusted_proxies": "addresses or CIDR ranges (at most 256) whose forwarding "
    "headers name the client; none: the stream's own peer is",
    "picker.tls.cert": "TLS on the picker port: certificate chain (PEM; `--picker-tls-cert`); "
    "null: the main port's `tls`",
    "picker.tls.key": "its private key (PEM)",
    "picker.tls.client_ca": "require Envoy's client certificate, signed by this CA (mTLS)",
    "picker.plaintext": "a `listen` past loopback without TLS, where the network encrypts "
    "the hop itself (a service mesh); else refused at start",
    "processes": "serving processes sharing the main port (`auto`: usable cores)",
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


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _fields(cls: type, prefix: str, skip: Sequence[str] = ()) -> Iterator[_Found]:
    hints = typing.get_type_hints(cls, include_extras=True)
    for field in dataclasses.fields(cls):
        if field.name not in skip:
            yield from _walk(f"{prefix}{field.name}", hints[field.name], _default(field))


def _sources(hint: Any) -> tuple[type, ...]:
    """The sections of a tagged union (`Annotated[A | B, Field(discriminator=...)]`)."""
    if typing.get_origin(hint) is not Annotated:
        return ()
    members = typing.get_args(typing.get_args(hint)[0])
    return members if members and all(_is_section(m) for m in members) else ()


def _walk(path: str, hint: Any, default: Any) -> Iterator[_Found]:
    """Every key under `path`: a section's keys, a list's entries, a mapping's values."""
    inner, optional = _strip(hint)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if _is_section(inner):
        if optional:  # a section that is off unless given (flow:)
            yield _Found(path, "section", ABSENT)
        yield from _fields(inner, f"{path}.")
    elif origin is tuple and _strip(args[0])[0] is WorkerSpec:
        yield _Found(path + "[]", "worker URL \\| mapping", default)
        yield _Found(path + "[].url", str, dataclasses.MISSING)
        kept = [f.name for f in dataclasses.fields(WorkerSpec) if f.name not in WORKER_URL_KEYS]
        yield from _fields(WorkerSpec, f"{path}[].", skip=kept)
    elif origin is tuple and _sources(args[0]):  # discovery sources
        sources = _sources(args[0])
        tags = [typing.get_args(typing.get_type_hints(s)["source"])[0] for s in sources]
        yield _Found(path + "[]", "list", default)
        yield _Found(path + "[].source", Literal[tuple(tags)], dataclasses.MISSING)
        for source, tag in zip(sources, tags, strict=True):
            yield from _fields(source, f"{path}[{tag}].", skip=("source",))
    elif origin is tuple and _is_section(args[0]):  # flow.classes
        yield _Found(path, "list of mappings", default)
        yield from _fields(args[0], f"{path}[].")
    elif origin is Mapping:
        yield _Found(path, "mapping", default)
        yield from _fields(args[1], f"{path}.{MAPPING_KEYS[path]}.")
    else:
        yield _Found(path, hint, default)


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
    found += [_Found(old, f"section (= `{new}`)", ABSENT) for old, new in RENAMED.items()]
    paths = [f.path for f in found]
    undescribed = [p for p in paths if p not in MEANING]
    gone = [p for p in (*MEANING, *SCOPE, *RELOAD) if p not in paths]
    if undescribed or gone:
        raise SystemExit(
            "scripts/gen_docs.py: "
            + (f"keys without a MEANING: {undescribed}; " if undescribed else "")
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
                meaning=MEANING[f.path],
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
