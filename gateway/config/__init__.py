"""Typed configuration: a YAML file and command-line flags, validated with clear errors.

The settings are frozen pydantic dataclasses: every field's type and bounds are declared
once, next to its default, and checked whether the value comes from the file, from a flag
(`build_config` merges the flags into the file's data before validating) or from code
(`dataclasses.replace` and the constructors validate too). Every problem raises
`ConfigError` with one line that names the bad value by its path in the file
(`limits.max_choices: must be at least 1, not 0`, `workers[0].role: ...`); the CLI
prints it and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import parse_qs, urlencode, urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ErrorDetails, PydanticCustomError

from gateway.core.policy_names import POLICIES as POLICIES  # re-exported: --policy choices
from gateway.core.policy_names import PolicyName
from gateway.core.roles import Role, Runtime

WORKER_URL_KEYS = (
    "model",
    "runtime",
    "role",
    "bootstrap_host",
    "bootstrap_port",
    "embedding_port",
)
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["console", "json"]
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)
MAX_NAME = 256  # characters in a model name
MAX_URL = 2048  # characters in a worker URL
MAX_PROCESSES = 64  # serving processes of one gateway
# Model names as engines serve them: `meta-llama/Llama-3-8B`, `qwen2.5:7b`, `org/m@v2`.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


class ConfigError(ValueError):
    """A configuration problem, told in one line."""


def _problem(message: str) -> PydanticCustomError:
    """A validation error whose message follows the field's path: `PATH: message`."""
    return PydanticCustomError("config", "{message}", {"message": message})


def _whole_line(message: str) -> PydanticCustomError:
    """A validation error whose message is the whole line (it names its fields itself)."""
    return PydanticCustomError("config_line", "{message}", {"message": message})


def _model_name_problem(name: str) -> str | None:
    if len(name) > MAX_NAME:
        return f"model name longer than {MAX_NAME} characters"
    if not MODEL_NAME.fullmatch(name):
        return (
            f"model name {name[:64]!r} has characters other than letters, digits and . _ : / @ + -"
        )
    return None


def check_model_name(name: str, what: str) -> str:
    problem = _model_name_problem(name)
    if problem is not None:
        raise ConfigError(f"{what}: {problem}")
    return name


def _model_name(name: str) -> str:
    problem = _model_name_problem(name)
    if problem is not None:
        raise _problem(problem)
    return name


def _processes(value: Any) -> int:
    try:
        return parse_processes(value)
    except ConfigError as exc:
        raise _whole_line(str(exc)) from None


def _off_is_none(value: Any) -> Any:
    return None if value == "off" else value


# -- the types of the fields: YAML's own type must match (no "3" for 3), bounds declared --

Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
Name = Annotated[str, Strict(), Field(min_length=1)]  # a path, token, header or host
Whole = Annotated[int, Strict(), Field(ge=0)]
AtLeastOne = Annotated[int, Strict(), Field(ge=1)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
Number = Annotated[float, Strict(), Field(ge=0)]  # a whole number is a number too
Seconds = Annotated[float, Strict(), Field(ge=0)]  # 0: off, or at once
Interval = Annotated[float, Strict(), Field(gt=0)]  # a period or timeout that must pass
Fraction = Annotated[float, Strict(), Field(ge=0, le=1)]
ModelName = Annotated[str, Strict(), AfterValidator(_model_name)]
HeaderName = Annotated[str, Strict(), Field(min_length=1), AfterValidator(str.lower)]
Processes = Annotated[int, BeforeValidator(_processes)]
MetricsListen = Annotated[Text | None, BeforeValidator(_off_is_none)]

# Unknown keys are errors; NaN and infinities are not numbers a setting can take.
SETTINGS = ConfigDict(extra="forbid", allow_inf_nan=False)


@dataclass(frozen=True, slots=True, config=SETTINGS)
class WorkerSpec:
    """One worker as configured; unknown `model`/`runtime` are discovered from the worker."""

    host: Name
    port: Port
    model: ModelName | None = None
    runtime: Runtime | None = None
    role: Role | None = None  # None: asked from the worker (GetServerInfo), else regular
    bootstrap_port: Port | None = None
    bootstrap_host: Name | None = None  # a prefill's rendezvous host; default: its URL host
    embedding_port: Port | None = None  # a prefill's port for encoder embeddings (EPD)
    tls: Flag = False  # grpcs://: TLS to the worker (see UpstreamTlsConfig)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'grpcs' if self.tls else 'grpc'}://{self.address}"

    def full_url(self) -> str:
        """The URL `parse_worker_url` reads back into this spec."""
        query = {key: getattr(self, key) for key in WORKER_URL_KEYS}
        given = {k: str(v) for k, v in query.items() if v is not None}
        return self.url + (f"?{urlencode(given)}" if given else "")


# -- workers: a URL, or a mapping with a url and the URL's query keys ----------------------


class _UrlProblem(ValueError):
    """What is wrong with a worker URL itself (not with one of its values)."""


def _port(key: str, value: str) -> int:
    if not value.isdigit() or not 0 < int(value) <= 65535:
        raise _UrlProblem(f"{key} {value!r} is not a port number")
    return int(value)


def _url_fields(url: str) -> dict[str, Any]:
    """A worker URL's fields, left for WorkerSpec to validate (ports made numbers)."""
    parts = urlsplit(url)
    if parts.scheme not in ("grpc", "grpcs"):
        raise _UrlProblem("scheme must be grpc:// or grpcs://")
    if parts.path not in ("", "/"):
        raise _UrlProblem(f"unexpected path {parts.path!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise _UrlProblem(str(exc)) from None
    if not host or port is None:
        raise _UrlProblem("needs HOST:PORT")
    if not 0 < port <= 65535:
        raise _UrlProblem(f"port {port} is not a port number")
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - set(WORKER_URL_KEYS))
    if unknown:
        raise _UrlProblem(f"unknown key {unknown[0]!r} (known: {', '.join(WORKER_URL_KEYS)})")
    fields: dict[str, Any] = {"host": host, "port": port, "tls": parts.scheme == "grpcs"}
    for key, values in query.items():
        value = values[-1]
        if value:  # `model=` is no model
            fields[key] = _port(key, value) if key.endswith("_port") else value
    return fields


def _checked_url_fields(url: str) -> dict[str, Any]:
    if len(url) > MAX_URL:
        raise _problem(f"URL longer than {MAX_URL} characters")
    try:
        return _url_fields(url)
    except _UrlProblem as exc:
        raise PydanticCustomError(
            "worker_url", "{url}: {problem}", {"url": repr(url), "problem": str(exc)}
        ) from None


def _worker_entry(entry: Any) -> Any:
    """One `workers:` entry as WorkerSpec's fields: a URL string, or a mapping whose
    `url` the other keys (the URL's query keys) add to or override."""
    if isinstance(entry, WorkerSpec):
        return entry
    if isinstance(entry, str):
        return _checked_url_fields(entry)
    if not isinstance(entry, Mapping):
        raise _problem(f"must be a worker URL or a mapping with a url, not {_show(entry)}")
    if "url" not in entry:
        raise _problem(f"{_show(dict(entry))} needs a url")
    known = ("url", *WORKER_URL_KEYS)
    unknown = sorted(str(k) for k in entry if k not in known)
    if unknown:
        raise _problem(f"unknown key {unknown[0]!r} (known: {', '.join(known)})")
    url = entry["url"]
    if not isinstance(url, str):
        raise _problem(f"url must be a string, not {_show(url)}")
    fields = _checked_url_fields(url)
    fields.update({k: v for k, v in entry.items() if k != "url" and v is not None})
    return fields


# A `workers:` entry: validated into a WorkerSpec whatever its form.
WorkerEntry = Annotated[WorkerSpec, BeforeValidator(_worker_entry)]
_WORKER: TypeAdapter[WorkerSpec] = TypeAdapter(WorkerEntry)


def parse_worker_url(url: str) -> WorkerSpec:
    """`grpc://HOST:PORT?model=M&runtime=sglang|vllm&role=...&bootstrap_port=N`."""
    if len(url) > MAX_URL:
        raise ConfigError(f"worker URL longer than {MAX_URL} characters")
    try:
        return _WORKER.validate_python(url)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "worker_url":
            message = str((error.get("ctx") or {})["problem"])
        else:
            message = _message(error)
        raise ConfigError(f"worker {url!r}: {message}") from None


_WORKERS: TypeAdapter[tuple[WorkerSpec, ...]] = TypeAdapter(tuple[WorkerEntry, ...])


def parse_worker_list(data: Any) -> tuple[WorkerSpec, ...]:
    """A file source's workers: a YAML list of `workers:` entries (or a mapping with
    `workers:`). ConfigError names the first bad entry."""
    if isinstance(data, Mapping) and set(data) == {"workers"}:
        data = data["workers"]
    if data is None:
        return ()
    try:
        specs = _WORKERS.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    _check_workers(specs)
    return specs


@dataclass(frozen=True, slots=True, config=SETTINGS)
class ModelSettings:
    """Per-model routing and limits (limits apply per worker; None means no limit).

    `encode_leg`: multimodal requests need the encode leg even while no encode worker is
    registered (so a missing encoder is LEG_NOT_DEPLOYED, not a silent text-only answer).
    """

    policy: PolicyName = "round_robin"
    encode_leg: Flag = False
    max_inflight: Whole | None = None
    max_waiting: Whole | None = None
    max_token_usage: Fraction | None = None


@dataclass(frozen=True, slots=True, config=SETTINGS)
class ProbeConfig:
    interval_s: Interval = 1.0
    timeout_s: Interval = 1.0
    success_threshold: AtLeastOne = 2
    failure_threshold: AtLeastOne = 2


@dataclass(frozen=True, slots=True, config=SETTINGS)
class BreakerConfig:
    failure_threshold: AtLeastOne = 5
    cooldown_s: Seconds = 5.0
    success_threshold: AtLeastOne = 2


@dataclass(frozen=True, slots=True, config=SETTINGS)
class LoadsConfig:
    interval_s: Interval = 1.0
    timeout_s: Interval = 1.0

    @property
    def stale_after_s(self) -> float:
        """A load report older than this is not trusted (three missed polls)."""
        return 3 * self.interval_s


@dataclass(frozen=True, slots=True, config=SETTINGS)
class DrainConfig:
    """SIGTERM: NOT_SERVING at once, serve `delay_s` more, then finish in-flight within
    `grace_s`. `worker_timeout_s` bounds the drain of one worker removed by the admin API."""

    delay_s: Seconds = 5.0
    grace_s: Seconds = 20.0
    worker_timeout_s: Seconds = 60.0


@dataclass(frozen=True, slots=True, config=SETTINGS)
class DisaggConfig:
    """`abort_wait_s`: how long an abort or cancel waits for a decode leg's first message
    before cutting it (a KV handoff torn in the middle can wedge the engines)."""

    abort_wait_s: Seconds = 30.0


@dataclass(frozen=True, slots=True, config=SETTINGS)
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
    Generate may carry. `max_completion_tokens`: what one choice of a Generate that sets
    no max new tokens is believed to generate; a worker's usage past what a call could
    have generated (its choices times its max new tokens, else this) is not believed."""

    max_choices: AtLeastOne = 16
    max_inflight_requests: AtLeastOne = 4096
    max_concurrent_streams: AtLeastOne = 256
    stream_idle_timeout_s: Seconds = 300.0
    connection_idle_timeout_s: Seconds = 300.0
    max_connection_age_s: Seconds = 3600.0
    connection_age_grace_s: Seconds = 600.0
    max_inflight_per_principal: AtLeastOne | None = None
    request_read_timeout_s: Interval = 30.0
    max_request_reads: AtLeastOne = 32
    max_request_reads_per_peer: AtLeastOne = 2
    max_connections: AtLeastOne = 10_000
    max_connections_per_peer: AtLeastOne = 1_000
    max_prompt_tokens: AtLeastOne = 1_000_000
    max_completion_tokens: AtLeastOne = 131_072

    @property
    def principal_share(self) -> int:
        """The calls one principal may hold: configured, else a quarter of the total."""
        if self.max_inflight_per_principal is not None:
            return self.max_inflight_per_principal
        return max(1, self.max_inflight_requests // 4)


@dataclass(frozen=True, slots=True, config=SETTINGS)
class UpstreamConfig:
    """HTTP/2 keepalive on worker channels: a worker that stops answering pings (frozen,
    or its host gone without a FIN) has its connection closed after `keepalive_time_s`
    + `keepalive_timeout_s`, and its calls fail over. Workers must accept pings that often
    (see the README); 0 turns keepalive off."""

    keepalive_time_s: Seconds = 10.0
    keepalive_timeout_s: Seconds = 5.0
    # What a worker may send ahead on one stream before the gateway's client reads it:
    # the fixed HTTP/2 stream window of worker channels (grpc's default grows to 4 MiB).
    stream_window_bytes: AtLeastOne = 256 * 1024
    # A worker's response headers, and its trailers, as relayed to the client: at most this
    # many entries of at most this many bytes in all (HTTP/2's count: key + value + 32 per
    # entry), the rest dropped; clients refuse a block over 8 KiB at random (grpc's soft
    # limit), and the gateway's own trailers and the status message go in the same block.
    max_relayed_metadata_bytes: Annotated[int, Strict(), Field(ge=0, le=16384)] = 4096
    max_relayed_metadata_entries: Annotated[int, Strict(), Field(ge=0, le=1024)] = 64


@dataclass(frozen=True, slots=True, config=SETTINGS)
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

    events: Flag = True
    block_size: AtLeastOne = 16
    prefill_cost_per_token: Number = 0.01
    balance_ratio: Number = 1.5
    balance_slack: Number = 4.0
    share_window_s: Interval = 10.0  # shares decay by exp(-age / share_window_s)
    assume_ttl_s: Seconds = 120.0
    assume_capacity: AtLeastOne = 100_000
    pending_ttl_s: Seconds = 120.0
    grace_s: Seconds = 10.0
    # Worker input is untrusted (see "Limits and security"): per worker at most
    # `max_ranks` DP ranks and `max_block_sizes` distinct block sizes are indexed (the
    # excess is refused, logged once); stored blocks are capped per worker and in all
    # (the worker's oldest entries go first); one KV event message may be at most
    # `max_event_bytes` (a bigger one is refused and the subscription starts again);
    # subscriptions that keep failing start again after up to `resubscribe_max_s`.
    max_ranks: AtLeastOne = 256
    max_block_sizes: AtLeastOne = 4
    max_blocks_per_worker: AtLeastOne = 250_000
    max_blocks: AtLeastOne = 2_000_000
    max_event_bytes: AtLeastOne = 4 * 1024 * 1024
    resubscribe_max_s: Seconds = 8.0


@dataclass(frozen=True, slots=True, config=SETTINGS)
class TlsConfig:
    """TLS on the main port (PEM files). With `client_ca`, clients must present a
    certificate it signed (mTLS); their identity is the caller's principal."""

    cert: Name | None = None
    key: Name | None = None
    client_ca: Name | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @model_validator(mode="after")
    def _pairs(self) -> TlsConfig:
        if (self.cert is None) != (self.key is None) or (self.client_ca and not self.cert):
            raise _problem("cert and key go together (and client_ca needs both)")
        return self


@dataclass(frozen=True, slots=True, config=SETTINGS)
class UpstreamTlsConfig:
    """TLS to `grpcs://` workers: `ca` verifies them (default: the system roots); `cert`
    and `key` are the gateway's client certificate where workers require mTLS."""

    ca: Name | None = None
    cert: Name | None = None
    key: Name | None = None

    @model_validator(mode="after")
    def _pairs(self) -> UpstreamTlsConfig:
        if (self.cert is None) != (self.key is None):
            raise _problem("cert and key go together")
        return self


@dataclass(frozen=True, slots=True, config=SETTINGS)
class AuthConfig:
    """`api_keys_file`: one `name:key` a line, read again on SIGHUP and when it changes.
    When set, every call on the main port needs `authorization: Bearer <key>`, but
    reflection and the probes' health names ("", liveness, readiness).

    `failure_limit` failed authentications from one peer address within
    `failure_window_s` refuse that address's calls for `block_s`; 0 turns that off."""

    api_keys_file: Name | None = None
    failure_limit: Whole = 20
    failure_window_s: Seconds = 10.0
    block_s: Seconds = 30.0

    @model_validator(mode="after")
    def _blocking(self) -> AuthConfig:
        if self.failure_limit and (self.failure_window_s <= 0 or self.block_s <= 0):
            raise _whole_line(
                "auth.failure_window_s and auth.block_s must be positive "
                "(auth.failure_limit: 0 turns blocking off)"
            )
        return self


@dataclass(frozen=True, slots=True, config=SETTINGS)
class AdminConfig:
    # HOST:PORT, checked by build_config (a serving process's is its `unix:` control socket)
    listen: Text = "127.0.0.1:50052"
    token: Name | None = None


@dataclass(frozen=True, slots=True, config=SETTINGS)
class TracingConfig:
    """OpenTelemetry traces over OTLP/gRPC (see README "Observability"): on when an
    endpoint is set here or in OTEL_EXPORTER_OTLP_TRACES_ENDPOINT/OTEL_EXPORTER_OTLP_ENDPOINT;
    what is not set here comes from the standard OTEL_* variables."""

    endpoint: Text | None = None  # e.g. http://collector:4317 (http: plaintext)
    insecure: Flag | None = None  # None: from the endpoint's scheme, or the environment
    sample_ratio: Annotated[float, Strict(), Field(ge=0, le=1)] | None = None  # parent-based
    service_name: Text | None = None  # None: OTEL_SERVICE_NAME, else model-gateway
    max_queue: AtLeastOne = 2048  # spans waiting for export; past it the oldest are dropped
    batch_size: AtLeastOne = 512
    schedule_delay_ms: AtLeastOne = 1000
    export_timeout_s: Interval = 10.0


@dataclass(frozen=True, slots=True, config=SETTINGS)
class MetricsConfig:
    listen: MetricsListen = "127.0.0.1:9464"  # "off": None, no endpoint


@dataclass(frozen=True, slots=True, config=SETTINGS)
class OrcaConfig:
    """ORCA load reports of each serving process (gateway/orca). `trailers`: every engine
    call's trailers end with `endpoint-load-metrics-bin`; `min_interval_s`: the shortest
    interval a StreamCoreMetrics stream gets, whatever it asks; `max_streams`: those
    streams open at once, per serving process; `max_streams_per_connection`: those one
    client connection may hold; `max_streams_per_peer`: those one principal (API key,
    client certificate, else peer address) may hold, None: a quarter of `max_streams`."""

    trailers: Flag = True
    min_interval_s: Interval = 1.0
    max_streams: AtLeastOne = 256
    max_streams_per_connection: AtLeastOne = 4
    max_streams_per_peer: AtLeastOne | None = None

    @property
    def peer_share(self) -> int:
        """The streams one principal or peer may hold: configured, else a quarter."""
        if self.max_streams_per_peer is not None:
            return self.max_streams_per_peer
        return max(1, self.max_streams // 4)


# -- discovery: sources of workers, each feeding the fleet's one door -----------------------


def _host_and_port(text: str) -> str:
    if _host_port(text) is None:
        raise _problem(f"{text!r} is not HOST:PORT")
    return text


def _label_or_annotation(text: str) -> str:
    kind, _, key = text.partition(":")
    if kind not in ("label", "annotation") or not key:
        raise _problem(f"{text!r} must be label:KEY or annotation:KEY")
    return text


def _container_port(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _problem(f"must be a port number or a container port name, not {_show(value)}")
    if isinstance(value, int) and not 1 <= value <= 65535:
        raise _problem(f"must be a port number from 1 to 65535, not {value}")
    if isinstance(value, str) and not value:
        raise _problem("must not be empty")
    return value


DISCOVERY_TAGS = ("dns", "kubernetes", "file")
HostPort = Annotated[str, Strict(), AfterValidator(_host_and_port)]
PodField = Annotated[str, Strict(), AfterValidator(_label_or_annotation)]
ContainerPort = Annotated[int | str, BeforeValidator(_container_port)]


@dataclass(frozen=True, slots=True, config=SETTINGS)
class DnsDiscovery:
    """Workers at the addresses `name` resolves to: its A/AAAA records with `port`, or
    (no port) its SRV records, each naming a host and its port. Resolved again every
    `interval_s`, sooner when the records' TTL is shorter, never faster than 1 s. An
    answer with more than `max_hosts` hosts (or SRV records) is refused: the last stay."""

    source: Literal["dns"]
    name: Name
    port: Port | None = None
    nameserver: HostPort | None = None  # default: the system's resolver
    interval_s: Annotated[float, Strict(), Field(ge=1)] = 5.0
    model: ModelName | None = None  # None: asked from each worker
    runtime: Runtime | None = None
    role: Role | None = None
    tls: Flag = False
    max_hosts: AtLeastOne = 256

    @property
    def label(self) -> str:
        return f"dns:{self.name}"


@dataclass(frozen=True, slots=True, config=SETTINGS)
class KubernetesDiscovery:
    """Workers that are the Pods `selector` matches in `namespace`, at their container
    port `port` (a name or a number). A Pod is in service while Running, Ready and not
    terminating; out of service longer than `unready_grace_s`, it leaves. A list of more
    than `max_hosts` hosts is refused: the last stay."""

    source: Literal["kubernetes"]
    port: ContainerPort
    selector: Text = ""
    namespace: Name | None = None  # None: the pod's own (in cluster), else kubeconfig's
    model: ModelName | None = None
    model_from: PodField | None = None  # label:KEY or annotation:KEY, instead of model
    runtime: Runtime | None = None
    role: Role | None = None
    tls: Flag = False
    bootstrap_port_annotation: Name | None = None  # SGLang PD: a prefill's bootstrap port
    unready_grace_s: Seconds = 30.0
    resync_s: Interval = 60.0
    kubeconfig: Name | None = None  # None: in-cluster credentials, else $KUBECONFIG or ~/.kube
    max_hosts: AtLeastOne = 256

    @property
    def label(self) -> str:
        where = f"{self.namespace}/" if self.namespace else ""  # none: the client's own
        return f"kubernetes:{where}{self.selector or '*'}"

    @model_validator(mode="after")
    def _one_model(self) -> KubernetesDiscovery:
        if self.model is not None and self.model_from is not None:
            raise _problem("give model or model_from, not both")
        return self


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FileDiscovery:
    """Workers listed in a YAML file (a list of worker URLs or `workers:` entries),
    read again when it changes (checked every `interval_s`). A file of more than
    `max_hosts` hosts, or larger than 256 bytes a host (64 KiB by default), is refused:
    the last hosts stay."""

    source: Literal["file"]
    path: Name
    interval_s: Interval = 1.0
    max_hosts: AtLeastOne = 256

    @property
    def label(self) -> str:
        return f"file:{self.path}"


DiscoverySource = Annotated[
    DnsDiscovery | KubernetesDiscovery | FileDiscovery, Field(discriminator="source")
]


# -- flow control: queues instead of refusals when every worker is busy --------------------


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FlowClassConfig:
    """A priority class; `starvation_s`: waited this long, served next, ahead of every
    class (so even a flood of higher classes cannot hold it back longer)."""

    name: Name
    ttl_s: Interval = 60.0
    starvation_s: Interval | None = None


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FlowQueueConfig:
    """Per model: requests waiting, and the bytes of their requests."""

    max_requests: AtLeastOne = 2048
    max_bytes: AtLeastOne = 256 * 1024 * 1024


DEFAULT_COST_TOKENS = 256
DEFAULT_TENANT_LABELS = 20


def _standard_classes() -> tuple[FlowClassConfig, ...]:
    return (
        FlowClassConfig("interactive", ttl_s=30.0),
        FlowClassConfig("standard", ttl_s=60.0),
        FlowClassConfig("batch", ttl_s=300.0, starvation_s=60.0),
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FlowConfig:
    """When every worker of a model is at its limits, requests wait (see README "Flow
    control") instead of being refused at once; without a `flow:` section they are."""

    classes: tuple[FlowClassConfig, ...] = dataclasses.field(default_factory=_standard_classes)
    default_class: Name = "standard"
    priority_header: HeaderName = "x-priority"
    queue: FlowQueueConfig = dataclasses.field(default_factory=FlowQueueConfig)
    trust_tenant_header: Flag = False  # true: x-tenant-id names the tenant
    tenant_header: HeaderName = "x-tenant-id"
    # A call's output when it does not set its max new tokens (its cost, its token budget).
    cost_tokens: AtLeastOne = DEFAULT_COST_TOKENS
    # Tenants named in per-tenant metrics at once; the rest `other`.
    tenant_labels: Whole = DEFAULT_TENANT_LABELS

    @model_validator(mode="after")
    def _known_classes(self) -> FlowConfig:
        names = [c.name for c in self.classes]
        if not names:
            raise _problem("classes: give at least one class")
        if len(set(names)) != len(names):
            raise _problem(f"classes: a class is named twice ({', '.join(names)})")
        if self.default_class not in names:
            raise _problem(f"default_class: {self.default_class!r} is not one of {names}")
        return self

    def index(self, name: str) -> int | None:
        return next((i for i, c in enumerate(self.classes) if c.name == name), None)


@dataclass(frozen=True, slots=True, config=SETTINGS)
class TenantConfig:
    """A tenant (an API key's name, a client certificate's identity; `default` for the
    rest): the highest class it may ask for, and its share within a class."""

    max_class: Name | None = None  # None: any class
    weight: Annotated[float, Strict(), Field(gt=0)] = 1.0
    max_inflight: AtLeastOne | None = None  # its calls in flight; past it, they wait
    requests_per_minute: AtLeastOne | None = None  # past it: RATE_LIMITED
    tokens_per_minute: AtLeastOne | None = None  # prompt + generated tokens; past it: too

    def shared(self, share: Callable[[int], int]) -> TenantConfig:
        """One serving process's part of the tenant's limits (`--processes N`)."""
        return dataclasses.replace(
            self,
            max_inflight=_maybe(share, self.max_inflight),
            requests_per_minute=_maybe(share, self.requests_per_minute),
            tokens_per_minute=_maybe(share, self.tokens_per_minute),
        )


def _maybe(share: Callable[[int], int], limit: int | None) -> int | None:
    return None if limit is None else share(limit)


@functools.cache
def _default_settings(policy: PolicyName) -> ModelSettings:
    """What a model without settings of its own runs with (built once per policy)."""
    return ModelSettings(policy=policy)


@dataclass(frozen=True, slots=True, config=SETTINGS)
class GatewayConfig:
    listen: Text = "127.0.0.1:50051"
    workers: tuple[WorkerEntry, ...] = ()
    discovery: tuple[DiscoverySource, ...] = ()
    flow: FlowConfig | None = None
    tenants: Mapping[Name, TenantConfig] = dataclasses.field(default_factory=dict)
    models: Mapping[ModelName, ModelSettings] = dataclasses.field(default_factory=dict)
    default_policy: PolicyName = "round_robin"
    model_headers: tuple[HeaderName, ...] = ("x-model-id", "x-gateway-model-name")
    routing_key_header: Name = "x-routing-key"
    target_worker_header: Name = "x-target-worker"
    max_attempts: AtLeastOne = 3
    retry_after_ms: Whole = 1000
    discovery_timeout_s: Seconds = 5.0
    max_message_bytes: AtLeastOne = 64 * 1024 * 1024
    log_format: LogFormat = "console"
    log_level: LogLevel = "info"
    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)
    breaker: BreakerConfig = dataclasses.field(default_factory=BreakerConfig)
    loads: LoadsConfig = dataclasses.field(default_factory=LoadsConfig)
    drain: DrainConfig = dataclasses.field(default_factory=DrainConfig)
    disagg: DisaggConfig = dataclasses.field(default_factory=DisaggConfig)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    upstream: UpstreamConfig = dataclasses.field(default_factory=UpstreamConfig)
    tls: TlsConfig = dataclasses.field(default_factory=TlsConfig)
    upstream_tls: UpstreamTlsConfig = dataclasses.field(default_factory=UpstreamTlsConfig)
    auth: AuthConfig = dataclasses.field(default_factory=AuthConfig)
    kv: KvConfig = dataclasses.field(default_factory=KvConfig)
    admin: AdminConfig = dataclasses.field(default_factory=AdminConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    tracing: TracingConfig = dataclasses.field(default_factory=TracingConfig)
    orca: OrcaConfig = dataclasses.field(default_factory=OrcaConfig)
    processes: Processes = 1  # serving processes behind the main port (`auto`: usable cores)

    def model(self, name: str) -> ModelSettings:
        found = self.models.get(name)
        return found if found is not None else _default_settings(self.default_policy)

    def tenant(self, name: str) -> TenantConfig:
        found = self.tenants.get(name) or self.tenants.get("default")
        return found if found is not None else _DEFAULT_TENANT

    def policy_for(self, model: str) -> str:
        return self.model(model).policy


_DEFAULT_TENANT = TenantConfig()


def _check_flow(config: GatewayConfig) -> None:
    flow = config.flow
    for name, tenant in config.tenants.items():
        if tenant.max_class is not None and (flow is None or flow.index(tenant.max_class) is None):
            known = [c.name for c in flow.classes] if flow is not None else []
            raise ConfigError(
                f"tenants.{name}.max_class: {tenant.max_class!r} is not a flow class {known}"
            )


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
    "tracing": TracingConfig,
    "orca": OrcaConfig,
}


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


def _host_port(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return None
    return host.strip("[]"), int(port)


def parse_address(text: str, what: str) -> tuple[str, int]:
    address = _host_port(text)
    if address is None:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT")
    return address


# -- reading the file --------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that also refuses a key given twice in one mapping (YAML
    forbids it; PyYAML would keep the last value without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: the keys it brings may be overridden here
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # an unhashable key: the safe loader's own error says so
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found key {key!r} twice",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(str(exc.problem or exc.context or "").split())
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"not valid YAML{where}: {problem}" if problem else f"not valid YAML{where}"
    return f"not valid YAML ({' '.join(str(exc).split())})"


def load_file(path: str) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: {exc.strerror or exc}") from None
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r}: not UTF-8 (byte {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_Loader) or {}  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r}: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: top level must be a mapping")
    return data


# -- one line per problem ----------------------------------------------------------------

_PLAIN_KEY = re.compile(r"[^.\[\]'\"\s]+")


def _path(loc: Sequence[int | str]) -> str:
    """`limits.max_choices`, `workers[0].role`, `models['qwen2.5:7b'].policy`."""
    text = ""
    for i, item in enumerate(loc):
        if item == "[key]":  # the mapping key itself was wrong: the path names it already
            continue
        if item in DISCOVERY_TAGS and "discovery" in loc[max(0, i - 2) : i]:
            continue  # the union member pydantic tried: not a key of the file
        if isinstance(item, int):
            text += f"[{item}]"
        elif _PLAIN_KEY.fullmatch(item):
            text += f".{item}" if text else item
        else:
            text += f"[{item!r}]"
    return text


def _show(value: Any) -> str:
    """A value as the file would have it (YAML's true/false/null), at most 80 characters."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bool_hint(value: Any, loc: Sequence[int | str]) -> str:
    """YAML 1.1 reads bare on/off/yes/no as booleans, where a string was meant."""
    if value is True:
        return " (YAML reads a bare on, yes or true as true: put the value in quotes)"
    if value is False and tuple(loc[-2:]) == ("metrics", "listen"):
        return " (YAML reads a bare off as false: write listen: 'off' to turn metrics off)"
    if value is False:
        return " (YAML reads a bare off, no or false as false: put the value in quotes)"
    return ""


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _choices(expected: str) -> str:
    """`'a', 'b' or 'c'` (pydantic's list of allowed values) as `a|b|c`."""
    return "|".join(re.findall(r"'([^']*)'", expected))


def _message(error: ErrorDetails) -> str:
    """What is wrong, without the path."""
    kind, value, ctx = error["type"], error["input"], error.get("ctx") or {}
    loc = error["loc"]
    shown = _show(value)
    if kind in ("config", "config_line"):
        return str(ctx["message"])
    if kind == "worker_url":
        return f"{ctx['url']}: {ctx['problem']}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be a whole number, not {shown}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number, not {shown}"
    if kind == "finite_number":
        return f"must be a finite number, not {shown}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, not {shown}"
    if kind == "string_type":
        return f"must be a string, not {shown}{_bool_hint(value, loc)}"
    if kind in ("list_type", "tuple_type", "set_type", "iterable_type"):
        return f"must be a list, not {shown}"
    if kind in ("dict_type", "mapping_type", "dataclass_type", "dataclass_exact_type"):
        return f"must be a mapping, not {shown}"
    if kind == "greater_than_equal":
        return f"must be at least {_number(ctx['ge'])}, not {shown}"
    if kind == "greater_than":
        return f"must be greater than {_number(ctx['gt'])}, not {shown}"
    if kind == "less_than_equal":
        return f"must be at most {_number(ctx['le'])}, not {shown}"
    if kind == "less_than":
        return f"must be less than {_number(ctx['lt'])}, not {shown}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind in ("literal_error", "enum"):
        what = "policy" if loc and loc[-1] in ("policy", "default_policy") else "value"
        expected = _choices(str(ctx.get("expected", "")))
        return f"unknown {what} {shown} (expected {expected})"
    if kind in ("missing", "missing_argument"):
        return "must be given"
    if kind == "union_tag_invalid":
        return f"unknown source {_show(ctx.get('tag'))} (expected {'|'.join(DISCOVERY_TAGS)})"
    if kind == "union_tag_not_found":
        return f"needs a source ({'|'.join(DISCOVERY_TAGS)})"
    return str(error["msg"]).replace("Input should be", "must be").replace("Value error, ", "")


def _known_keys(parent: Sequence[int | str]) -> tuple[str, ...]:
    """The keys a section takes, for an unknown-key message (none listed at the top)."""
    if len(parent) == 1 and parent[0] in SECTIONS:
        cls = SECTIONS[str(parent[0])]
    elif len(parent) == 2 and parent[0] == "models":
        cls = ModelSettings
    else:
        return ()
    return tuple(f.name for f in dataclasses.fields(cls))


def _line(error: ErrorDetails) -> str:
    """One error as `PATH: problem`."""
    loc = error["loc"]
    if error["type"] == "config_line":
        return _message(error)
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden", "invalid_key"):
        parent, key = loc[:-1], loc[-1]
        known = _known_keys(parent)
        listed = f" (known: {', '.join(known)})" if known else ""
        return f"{_path(parent) or 'config'}: unknown key {key!r}{listed}"
    return f"{_path(loc) or 'config'}: {_message(error)}"


def _one_line(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    more = len(errors) - 1
    if more:  # still one line: the others show once this one is fixed
        return f"{_line(errors[0])} (and {more} more problem{'s' if more > 1 else ''})"
    return _line(errors[0])


# -- putting it together -----------------------------------------------------------------

_GATEWAY = TypeAdapter(GatewayConfig)


def _merged(
    file_data: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The file's data with the flags written in (`section.key` into its section), so
    both go through the same validation. An empty section (`probe:`) is the defaults."""
    data = dict(file_data or {})
    for key in (*SECTIONS, "workers", "models"):
        if key in data and data[key] is None:
            del data[key]
    for key, value in (overrides or {}).items():
        if value is None:  # the flag was not given
            continue
        section, dot, name = key.partition(".")
        if not dot:
            data[key] = value
        elif isinstance(data.get(section, {}), Mapping):
            data[section] = {**data.get(section, {}), name: value}
        # else: the section is not a mapping, which validation reports
    models = data.get("models")
    policy = data.get("default_policy", "round_robin")
    if isinstance(models, Mapping) and isinstance(policy, str) and policy in POLICIES:
        data["models"] = {name: _inherit(settings, policy) for name, settings in models.items()}
    return data


def _inherit(settings: Any, policy: str) -> Any:
    """A model's settings with the default policy where they name none (`m:` alone too)."""
    if settings is None:
        settings = {}
    if isinstance(settings, Mapping) and "policy" not in settings:
        return {"policy": policy, **settings}
    return settings


def _check_addresses(config: GatewayConfig) -> None:
    """HOST:PORT where the gateway listens, and no open admin port without a token."""
    listens = [("listen", config.listen), ("admin.listen", config.admin.listen)]
    if config.metrics.listen is not None:
        listens.append(("metrics.listen", config.metrics.listen))
    for path, text in listens:
        if _host_port(text) is None:
            raise ConfigError(f"{path}: {text!r} is not HOST:PORT")
    admin_host, _ = parse_address(config.admin.listen, "admin.listen")
    if not config.admin.token and not _loopback(admin_host):
        raise ConfigError(
            f"admin.listen: {config.admin.listen!r} is not loopback: give the admin "
            "API a token (admin.token, --admin-token-file or GATEWAY_ADMIN_TOKEN)"
        )


def _check_workers(workers: Sequence[WorkerSpec]) -> None:
    seen: set[str] = set()
    for spec in workers:
        if spec.role is Role.ENCODE and not spec.model:
            raise ConfigError(f"worker {spec.address}: an encode worker needs model=")
        if spec.address in seen:
            raise ConfigError(f"worker {spec.address} is listed twice")
        seen.add(spec.address)


def build_config(
    file_data: Mapping[str, Any] | None = None,
    *,
    worker_urls: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Merge file, then flags (flags win), and validate everything."""
    try:
        config = _GATEWAY.validate_python(_merged(file_data, overrides))
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    flagged = tuple(parse_worker_url(url) for url in worker_urls)
    if flagged:
        config = dataclasses.replace(config, workers=config.workers + flagged)
    _check_addresses(config)
    _check_workers(config.workers)
    _check_flow(config)
    return config
