"""Typed configuration: a YAML file and command-line flags, validated with clear errors.

Every problem raises `ConfigError` with one line that names the bad value; the CLI
prints it and exits with status 2.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from gateway.roles import Role, Runtime

POLICIES = (
    "round_robin",
    "random",
    "power_of_two",
    "least_inflight",
    "consistent_hash",
    "manual",
    "cache_aware",
)
WORKER_URL_KEYS = (
    "model",
    "runtime",
    "role",
    "bootstrap_host",
    "bootstrap_port",
    "embedding_port",
)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_NAME = 256  # characters in a model name
MAX_URL = 2048  # characters in a worker URL
MAX_PROCESSES = 64  # serving processes of one gateway
# Model names as engines serve them: `meta-llama/Llama-3-8B`, `qwen2.5:7b`, `org/m@v2`.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


class ConfigError(ValueError):
    """A configuration problem, told in one line."""


def check_model_name(name: str, what: str) -> str:
    if len(name) > MAX_NAME:
        raise ConfigError(f"{what}: model name longer than {MAX_NAME} characters")
    if not MODEL_NAME.fullmatch(name):
        raise ConfigError(
            f"{what}: model name {name[:64]!r} has characters other than letters, digits "
            "and . _ : / @ + -"
        )
    return name


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker as configured; unknown `model`/`runtime` are discovered from the worker."""

    host: str
    port: int
    model: str | None = None
    runtime: Runtime | None = None
    role: Role | None = None  # None: asked from the worker (GetServerInfo), else regular
    bootstrap_port: int | None = None
    bootstrap_host: str | None = None  # a prefill's rendezvous host; default: its URL host
    embedding_port: int | None = None  # a prefill's port for encoder embeddings (EPD)
    tls: bool = False  # grpcs://: TLS to the worker (see UpstreamTlsConfig)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'grpcs' if self.tls else 'grpc'}://{self.address}"


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Per-model routing and limits (limits apply per worker; None means no limit).

    `encode_leg`: multimodal requests need the encode leg even while no encode worker is
    registered (so a missing encoder is LEG_NOT_DEPLOYED, not a silent text-only answer).
    """

    policy: str = "round_robin"
    encode_leg: bool = False
    max_inflight: int | None = None
    max_waiting: int | None = None
    max_token_usage: float | None = None


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    interval_s: float = 1.0
    timeout_s: float = 1.0
    success_threshold: int = 2
    failure_threshold: int = 2


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5
    cooldown_s: float = 5.0
    success_threshold: int = 2


@dataclass(frozen=True, slots=True)
class LoadsConfig:
    interval_s: float = 1.0
    timeout_s: float = 1.0

    @property
    def stale_after_s(self) -> float:
        """A load report older than this is not trusted (three missed polls)."""
        return 3 * self.interval_s


@dataclass(frozen=True, slots=True)
class DrainConfig:
    """SIGTERM: NOT_SERVING at once, serve `delay_s` more, then finish in-flight within
    `grace_s`. `worker_timeout_s` bounds the drain of one worker removed by the admin API."""

    delay_s: float = 5.0
    grace_s: float = 20.0
    worker_timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """`abort_wait_s`: how long an abort or cancel waits for a decode leg's first message
    before cutting it (a KV handoff torn in the middle can wedge the engines)."""

    abort_wait_s: float = 30.0


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Bounds on what one client can make the gateway do.

    `max_choices`: the most `sampling_params.n` a Generate may ask for (a disaggregated
    request runs one prefill + decode pair per choice). `max_inflight_requests`: calls the
    gateway serves at once, over every protocol; over it, GATEWAY_OVERLOADED.
    `max_concurrent_streams`: per client connection (HTTP/2 SETTINGS; a client queues the
    rest). `stream_idle_timeout_s`: a stream on which no message moved either way for this
    long is ended. Connections with no call for `connection_idle_timeout_s` are closed;
    every connection is asked to go away after `max_connection_age_s` (so clients
    rebalance across replicas), its calls given `connection_age_grace_s` to finish.
    0 turns an idle timeout or the age limit off.

    `max_inflight_per_principal`: calls one principal (API key, client certificate, else
    peer address) may have in flight; None: a quarter of `max_inflight_requests`.
    `request_read_timeout_s`: from a stream's opening to its complete request message.
    `max_request_reads` / `max_request_reads_per_peer`: request messages read at once,
    over the gateway and per principal (a stream waits its turn, held back by HTTP/2 flow
    control meanwhile), so partially sent messages hold at most that many times
    `max_message_bytes`. `max_connections`: client connections at once (grpc core closes
    the ones past it); `max_connections_per_peer`: one client address's share of them (the
    newest past it are closed within a few seconds). `max_prompt_tokens`: prompt length a
    Generate may carry."""

    max_choices: int = 16
    max_inflight_requests: int = 4096
    max_concurrent_streams: int = 256
    stream_idle_timeout_s: float = 300.0
    connection_idle_timeout_s: float = 300.0
    max_connection_age_s: float = 3600.0
    connection_age_grace_s: float = 600.0
    max_inflight_per_principal: int | None = None
    request_read_timeout_s: float = 30.0
    max_request_reads: int = 32
    max_request_reads_per_peer: int = 2
    max_connections: int = 10_000
    max_connections_per_peer: int = 1_000
    max_prompt_tokens: int = 1_000_000

    @property
    def principal_share(self) -> int:
        """The calls one principal may hold: configured, else a quarter of the total."""
        if self.max_inflight_per_principal is not None:
            return self.max_inflight_per_principal
        return max(1, self.max_inflight_requests // 4)


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """HTTP/2 keepalive on worker channels: a worker that stops answering pings (frozen,
    or its host gone without a FIN) has its connection closed after `keepalive_time_s`
    + `keepalive_timeout_s`, and its calls fail over. Workers must accept pings that often
    (see the README); 0 turns keepalive off."""

    keepalive_time_s: float = 10.0
    keepalive_timeout_s: float = 5.0
    # What a worker may send ahead on one stream before the gateway's client reads it:
    # the fixed HTTP/2 stream window of worker channels (grpc's default grows to 4 MiB).
    stream_window_bytes: int = 256 * 1024


@dataclass(frozen=True, slots=True)
class KvConfig:
    """Cache-aware placement (policy `cache_aware`).

    cost(worker) = uncached prompt tokens x `prefill_cost_per_token` + load, where load is
    the gateway's own in-flight count on the worker plus what the worker last reported
    beyond it (KV event load record or GetLoads: other clients' requests). Balance guard:
    only workers whose load is at most `balance_ratio` x the least loaded candidate's +
    `balance_slack`, and whose share of the placements of the last `share_window_s` is at
    most `balance_ratio` x the mean share + 1, compete: affinity never piles requests on
    one worker. Workers without KV events are indexed from the gateway's own placements
    for `assume_ttl_s`, at most `assume_capacity` blocks each; on workers with events,
    where a prompt was placed is remembered for `pending_ttl_s` beside what the events say
    (also after the worker evicted it: sending it back keeps affinity, which measured
    better than moving it). A worker not ready for `grace_s` loses its entries."""

    events: bool = True
    block_size: int = 16
    prefill_cost_per_token: float = 0.01
    balance_ratio: float = 1.5
    balance_slack: float = 4.0
    share_window_s: float = 10.0
    assume_ttl_s: float = 120.0
    assume_capacity: int = 100_000
    pending_ttl_s: float = 120.0
    grace_s: float = 10.0
    # Worker input is untrusted (see "Limits and security"): per worker at most
    # `max_ranks` DP ranks and `max_block_sizes` distinct block sizes are indexed (the
    # excess is refused, logged once); stored blocks are capped per worker and in all
    # (the worker's oldest entries go first); one KV event message may be at most
    # `max_event_bytes` (a bigger one is refused and the subscription starts again);
    # subscriptions that keep failing start again after up to `resubscribe_max_s`.
    max_ranks: int = 256
    max_block_sizes: int = 4
    max_blocks_per_worker: int = 250_000
    max_blocks: int = 2_000_000
    max_event_bytes: int = 4 * 1024 * 1024
    resubscribe_max_s: float = 8.0


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS on the main port (PEM files). With `client_ca`, clients must present a
    certificate it signed (mTLS); their identity is the caller's principal."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True, slots=True)
class UpstreamTlsConfig:
    """TLS to `grpcs://` workers: `ca` verifies them (default: the system roots); `cert`
    and `key` are the gateway's client certificate where workers require mTLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """`api_keys_file`: one `name:key` a line, read again on SIGHUP and when it changes.
    When set, every call on the main port needs `authorization: Bearer <key>`, but
    reflection and the probes' health names ("", liveness, readiness).

    `failure_limit` failed authentications from one peer address within
    `failure_window_s` refuse that address's calls for `block_s`; 0 turns that off."""

    api_keys_file: str | None = None
    failure_limit: int = 20
    failure_window_s: float = 10.0
    block_s: float = 30.0


@dataclass(frozen=True, slots=True)
class AdminConfig:
    listen: str = "127.0.0.1:50052"
    token: str | None = None


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    listen: str | None = "127.0.0.1:9464"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    listen: str = "127.0.0.1:50051"
    workers: tuple[WorkerSpec, ...] = ()
    models: Mapping[str, ModelSettings] = field(default_factory=dict)
    default_policy: str = "round_robin"
    model_headers: tuple[str, ...] = ("x-model-id", "x-gateway-model-name")
    routing_key_header: str = "x-routing-key"
    target_worker_header: str = "x-target-worker"
    max_attempts: int = 3
    retry_after_ms: int = 1000
    discovery_timeout_s: float = 5.0
    max_message_bytes: int = 64 * 1024 * 1024
    log_format: str = "console"
    log_level: str = "info"
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    loads: LoadsConfig = field(default_factory=LoadsConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    upstream_tls: UpstreamTlsConfig = field(default_factory=UpstreamTlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    processes: int = 1  # serving processes behind the main port (`auto`: usable cores)

    def model(self, name: str) -> ModelSettings:
        return self.models.get(name) or ModelSettings(policy=self.default_policy)

    def policy_for(self, model: str) -> str:
        return self.model(model).policy


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2, as a container sees it
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1: cpu.cfs_quota_us, cpu.cfs_period_us


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX, v1: Path = CGROUP_V1_CPU) -> int:
    """The cores this process may use: its CPU affinity, capped by a container's CPU
    quota (a Kubernetes CPU limit of 2 on a 64-core node is 2), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cpu_quota(cpu_max, v1)
    return max(1, min(cores, quota) if quota is not None else cores)


def _cpu_quota(cpu_max: Path, v1: Path) -> int | None:
    """The cgroup CPU quota in whole cores (rounded up), or None without one."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
            period = (v1 / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not quota.isdigit() or not period.isdigit() or period == "0":
        return None
    return max(1, -(-int(quota) // int(period)))


def parse_processes(value: Any) -> int:
    """`processes`: a whole number from 1 to MAX_PROCESSES, or `auto` (usable cores)."""
    if value == "auto":
        return min(usable_cores(), MAX_PROCESSES)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROCESSES:
        raise ConfigError(f"processes must be auto or 1..{MAX_PROCESSES}, not {value!r}")
    return value


def parse_address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _enum(kind: type[Runtime] | type[Role], value: str, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = "|".join(m.value for m in kind)
        raise ConfigError(f"{what}: unknown value {value!r} (expected {allowed})") from None


def _port(value: Any, what: str) -> int:
    if isinstance(value, bool) or not str(value).isdigit() or not 0 < int(value) <= 65535:
        raise ConfigError(f"{what}: {value!r} is not a port number")
    return int(value)


def parse_worker_url(url: str) -> WorkerSpec:
    """`grpc://HOST:PORT?model=M&runtime=sglang|vllm&role=...&bootstrap_port=N`."""
    if len(url) > MAX_URL:
        raise ConfigError(f"worker URL longer than {MAX_URL} characters")
    parts = urlsplit(url)
    what = f"worker {url!r}"
    if parts.scheme not in ("grpc", "grpcs"):
        raise ConfigError(f"{what}: scheme must be grpc:// or grpcs://")
    if parts.path not in ("", "/"):
        raise ConfigError(f"{what}: unexpected path {parts.path!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    if not host or port is None:
        raise ConfigError(f"{what}: needs HOST:PORT")
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - set(WORKER_URL_KEYS))
    if unknown:
        raise ConfigError(
            f"{what}: unknown key {unknown[0]!r} (known: {', '.join(WORKER_URL_KEYS)})"
        )
    spec = _worker_from_fields(host, port, {k: v[-1] for k, v in query.items()}, what)
    return replace(spec, tls=parts.scheme == "grpcs")


def _worker_from_fields(host: str, port: int, fields: Mapping[str, Any], what: str) -> WorkerSpec:
    model = fields.get("model") or None
    runtime = _enum(Runtime, str(fields["runtime"]), what) if fields.get("runtime") else None
    role = _enum(Role, str(fields["role"]), what) if fields.get("role") else None
    bootstrap = fields.get("bootstrap_port")
    embedding = fields.get("embedding_port")
    return WorkerSpec(
        host=host,
        port=_port(port, what),
        model=check_model_name(str(model), what) if model is not None else None,
        runtime=runtime,
        role=role,
        bootstrap_port=_port(bootstrap, what) if bootstrap not in (None, "") else None,
        bootstrap_host=str(fields["bootstrap_host"]) if fields.get("bootstrap_host") else None,
        embedding_port=_port(embedding, what) if embedding not in (None, "") else None,
    )


def _worker_from_yaml(entry: Any) -> WorkerSpec:
    if isinstance(entry, str):
        return parse_worker_url(entry)
    if not isinstance(entry, dict) or "url" not in entry:
        raise ConfigError(f"workers: entry {entry!r} needs a url")
    spec = parse_worker_url(str(entry["url"]))
    extra = {k: v for k, v in entry.items() if k != "url"}
    unknown = sorted(set(extra) - set(WORKER_URL_KEYS))
    if unknown:
        raise ConfigError(f"worker {entry['url']!r}: unknown key {unknown[0]!r}")
    merged = {
        "model": spec.model,
        "runtime": spec.runtime,
        "role": spec.role,
        "bootstrap_port": spec.bootstrap_port,
        "bootstrap_host": spec.bootstrap_host,
        "embedding_port": spec.embedding_port,
    }
    merged.update({k: v for k, v in extra.items() if v is not None})
    return _worker_from_fields(spec.host, spec.port, merged, f"worker {entry['url']!r}")


def _check_policy(policy: str, what: str) -> str:
    if policy not in POLICIES:
        raise ConfigError(f"{what}: unknown policy {policy!r} (expected {'|'.join(POLICIES)})")
    return policy


def load_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"config file {path!r}: not valid YAML ({exc.__class__.__name__})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: top level must be a mapping")
    return data


SECTIONS: dict[str, type] = {
    "probe": ProbeConfig,
    "breaker": BreakerConfig,
    "loads": LoadsConfig,
    "drain": DrainConfig,
    "disagg": DisaggConfig,
    "limits": LimitsConfig,
    "upstream": UpstreamConfig,
    "tls": TlsConfig,
    "upstream_tls": UpstreamTlsConfig,
    "auth": AuthConfig,
    "kv": KvConfig,
    "admin": AdminConfig,
    "metrics": MetricsConfig,
}


def _typed(value: Any, annotation: str, what: str) -> Any:
    """Coerce one YAML value to the field's declared type (`int`, `float | None`, ...)."""
    optional = annotation.endswith("| None")
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{what} must not be empty")
    base = annotation.removesuffix(" | None")
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{what} must be true or false, not {value!r}")
        return value
    kind = {"int": int, "float": float, "str": str}[base]
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{what} must be a string, not {value!r}")
        return value
    if isinstance(value, bool | str):
        raise ConfigError(f"{what} must be a number, not {value!r}")
    if kind is int and isinstance(value, float):
        raise ConfigError(f"{what} must be a whole number, not {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be {base}, not {value!r}") from None
    if kind is not str and number < 0:
        raise ConfigError(f"{what} must not be negative")
    return number


def _section(cls: type[Any], data: Any, what: str, base: Any = None) -> Any:
    """Build a settings dataclass from a YAML mapping, refusing unknown keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a mapping")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{what}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    values = {k: _typed(v, str(known[k].type), f"{what}.{k}") for k, v in data.items()}
    return replace(base if base is not None else cls(), **values)


_SCALARS: dict[str, type] = {
    "listen": str,
    "default_policy": str,
    "routing_key_header": str,
    "target_worker_header": str,
    "max_attempts": int,
    "retry_after_ms": int,
    "discovery_timeout_s": float,
    "max_message_bytes": int,
    "log_format": str,
    "log_level": str,
}


def build_config(
    file_data: Mapping[str, Any] | None = None,
    *,
    worker_urls: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Merge file, then flags (flags win), and validate everything."""
    data = dict(file_data or {})
    known = set(_SCALARS) | set(SECTIONS) | {"workers", "models", "model_headers", "processes"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config: unknown key {unknown[0]!r}")
    values: dict[str, Any] = {}
    for key, kind in _SCALARS.items():
        if key in data:
            values[key] = _typed(data[key], kind.__name__, key)
    for name, cls in SECTIONS.items():
        values[name] = _section(cls, data.get(name), name)
    if "processes" in data:
        values["processes"] = parse_processes(data["processes"])
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        section, dot, field_name = key.partition(".")
        if dot:
            values[section] = _section(
                SECTIONS[section], {field_name: value}, section, values[section]
            )
        else:
            values[key] = value
    workers = [_worker_from_yaml(w) for w in data.get("workers") or []]
    workers += [parse_worker_url(u) for u in worker_urls]
    models_raw = data.get("models") or {}
    if not isinstance(models_raw, dict):
        raise ConfigError("config: models must be a mapping of model name to settings")
    models: dict[str, ModelSettings] = {}
    default_policy = str(values.get("default_policy", "round_robin"))
    for name, settings in models_raw.items():
        what = f"model {name!r}"
        model = _section(ModelSettings, settings, what, ModelSettings(policy=default_policy))
        _check_policy(model.policy, what)
        models[str(name)] = model
    if "model_headers" in data:
        headers = data["model_headers"]
        if not isinstance(headers, list) or not all(isinstance(h, str) and h for h in headers):
            raise ConfigError(f"model_headers must be a list of header names, not {headers!r}")
        values["model_headers"] = tuple(h.lower() for h in headers)
    config = replace(GatewayConfig(), workers=tuple(workers), models=models, **values)
    parse_address(config.listen, "listen address")
    parse_address(config.admin.listen, "admin listen address")
    if config.metrics.listen == "off":
        config = replace(config, metrics=MetricsConfig(listen=None))
    if config.metrics.listen:
        parse_address(config.metrics.listen, "metrics listen address")
    for what, threshold in (
        ("probe.success_threshold", config.probe.success_threshold),
        ("probe.failure_threshold", config.probe.failure_threshold),
        ("breaker.failure_threshold", config.breaker.failure_threshold),
        ("breaker.success_threshold", config.breaker.success_threshold),
        ("limits.max_choices", config.limits.max_choices),
        ("limits.max_inflight_requests", config.limits.max_inflight_requests),
        ("limits.max_concurrent_streams", config.limits.max_concurrent_streams),
        ("limits.max_inflight_per_principal", config.limits.principal_share),
        ("limits.max_request_reads", config.limits.max_request_reads),
        ("limits.max_request_reads_per_peer", config.limits.max_request_reads_per_peer),
        ("limits.max_connections", config.limits.max_connections),
        ("limits.max_connections_per_peer", config.limits.max_connections_per_peer),
        ("limits.max_prompt_tokens", config.limits.max_prompt_tokens),
        ("upstream.stream_window_bytes", config.upstream.stream_window_bytes),
        ("kv.block_size", config.kv.block_size),
        ("kv.assume_capacity", config.kv.assume_capacity),
        ("kv.max_ranks", config.kv.max_ranks),
        ("kv.max_block_sizes", config.kv.max_block_sizes),
        ("kv.max_blocks_per_worker", config.kv.max_blocks_per_worker),
        ("kv.max_blocks", config.kv.max_blocks),
        ("kv.max_event_bytes", config.kv.max_event_bytes),
    ):
        if threshold < 1:
            raise ConfigError(f"{what} must be at least 1")
    if config.probe.interval_s <= 0 or config.loads.interval_s <= 0:
        raise ConfigError("probe and load intervals must be positive")
    _check_policy(config.default_policy, "default_policy")
    if config.log_format not in ("console", "json"):
        raise ConfigError(f"log_format: {config.log_format!r} (expected console|json)")
    tls = config.tls
    if (tls.cert is None) != (tls.key is None) or (tls.client_ca and not tls.cert):
        raise ConfigError("tls: cert and key go together (and client_ca needs both)")
    upstream_tls = config.upstream_tls
    if (upstream_tls.cert is None) != (upstream_tls.key is None):
        raise ConfigError("upstream_tls: cert and key go together")
    if config.log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level: {config.log_level!r} (expected {'|'.join(LOG_LEVELS)})")
    admin_host, _ = parse_address(config.admin.listen, "admin listen address")
    if not config.admin.token and not _loopback(admin_host):
        raise ConfigError(
            f"admin listen address {config.admin.listen!r} is not loopback: give the admin "
            "API a token (admin.token, --admin-token-file or GATEWAY_ADMIN_TOKEN)"
        )
    if config.max_attempts < 1:
        raise ConfigError("max_attempts must be at least 1")
    seen: set[str] = set()
    for spec in config.workers:
        if spec.role is Role.ENCODE and not spec.model:
            raise ConfigError(f"worker {spec.address}: an encode worker needs model=")
        if spec.address in seen:
            raise ConfigError(f"worker {spec.address} is listed twice")
        seen.add(spec.address)
    auth = config.auth
    if auth.failure_limit and (auth.failure_window_s <= 0 or auth.block_s <= 0):
        raise ConfigError(
            "auth.failure_window_s and auth.block_s must be positive "
            "(auth.failure_limit: 0 turns blocking off)"
        )
    return config
