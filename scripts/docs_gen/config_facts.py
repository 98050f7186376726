"""What the configuration table says that the schema in gateway/config does not: the
meaning of the few keys that are no field, whose a bound is (scope), when a key takes
effect (reload), and how types, defaults and units are shown."""

from __future__ import annotations

from typing import Any

from gateway.config.discovery import ContainerPort, HostPort, PodField
from gateway.config.fields import HeaderName, ModelName
from gateway.config.observability import MetricsListen
from gateway.config.processes import MAX_PROCESSES, Processes
from gateway.core.policy_names import POLICIES, PolicyName

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
    "tenants.<tenant>.requests_per_minute": f"{SPLIT}; fleet with `state:`",
    "tenants.<tenant>.tokens_per_minute": f"{SPLIT}; fleet with `state:`",
    "state.max_connections": "process",
    "state.max_value_bytes": "message",
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
    "models.<model>.route": "restart (admin API: live; with `state:`, every replica)",
    "models.<model>.route[].model": "restart (admin API: live)",
    "models.<model>.route[].weight": "restart (admin API: live)",
    "state.password_file": "file: read at start-up",
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
