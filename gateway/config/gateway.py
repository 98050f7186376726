"""`GatewayConfig`: every setting, top-level keys and sections (`SECTIONS`), and the
serving process's own sections (admin port, drain, disaggregation)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.affinity import AffinityConfig
from gateway.config.discovery import DiscoverySource
from gateway.config.fields import (
    SETTINGS,
    AtLeastOne,
    Flag,
    HeaderName,
    ModelName,
    Name,
    Seconds,
    Size,
    Text,
    Whole,
)
from gateway.config.flow import FlowConfig, TenantConfig
from gateway.config.kv import KvConfig
from gateway.config.limits import LimitsConfig
from gateway.config.lora import LoraConfig
from gateway.config.models import ModelSettings
from gateway.config.observability import (
    LogFormat,
    LogLevel,
    MetricsConfig,
    OrcaConfig,
    TracingConfig,
)
from gateway.config.picker import PickerConfig
from gateway.config.processes import Processes
from gateway.config.security import AuthConfig, TlsConfig, UpstreamTlsConfig
from gateway.config.slo import SloConfig
from gateway.config.state import StateConfig
from gateway.config.upstream import LoadsConfig, OutlierDetectionConfig, ProbeConfig, UpstreamConfig
from gateway.config.workers import WorkerEntry
from gateway.core.policy_names import PolicyName


@dataclass(frozen=True, slots=True, config=SETTINGS)
class DrainConfig:
    """SIGTERM: NOT_SERVING at once, serve `delay_s` more, then finish in-flight within
    `grace_s`. `worker_timeout_s` bounds the drain of one worker removed by the admin API."""

    delay_s: Seconds = Field(
        default=5.0, description="on SIGTERM: NOT_SERVING, serving on for this long"
    )
    grace_s: Seconds = Field(
        default=20.0, description="then in-flight calls get this long to finish"
    )
    worker_timeout_s: Seconds = Field(
        default=60.0, description="bounds the drain of one worker removed (admin, discovery)"
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class DisaggConfig:
    """`abort_wait_s`: how long an abort or cancel waits for a decode leg's first message
    before cutting it (a KV handoff torn in the middle can wedge the engines).
    `decode_first_message_timeout_s`: how long a decode leg may take to its first message
    from when it is called (vLLM: after its prefill answered; SGLang: with its prefill,
    whose compute then counts too); past it, with nothing relayed to the client yet, the
    attempt is given up and the call placed again without that decode. 0: no bound."""

    abort_wait_s: Seconds = Field(
        default=30.0,
        description="an abort or cancel waits this long for a decode leg's first message",
    )
    decode_first_message_timeout_s: Seconds = Field(
        default=0.0,
        description=(
            "a decode leg with no first message this long after it was "
            "called is given up and the call placed again (before any "
            "byte reached the client); 0: no bound"
        ),
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class MigrationConfig:
    """A Generate stream whose worker fails or leaves after tokens reached the client
    continues on another worker: the prompt and the tokens relayed so far are sent there,
    and the client's stream goes on. `max_migrations` per call (per choice of a split
    n > 1); `max_resent_tokens`: the longest prompt + relayed tokens a continuation
    re-sends (also what the gateway keeps of a stream's tokens). `max_kept_tokens`: the
    relayed token ids one serving process keeps for all its streams (packed, ~3 bytes
    each: ~96 MiB at the default); a stream whose tokens would go past it is no longer
    followed and cannot go on elsewhere (counted), so workers' output never grows memory
    unbounded."""

    enabled: Flag = Field(
        default=True,
        description="a stream whose worker fails after tokens went goes on elsewhere",
    )
    max_migrations: Whole = Field(
        default=2, description="continuations per call (per choice of a split n > 1)"
    )
    max_resent_tokens: AtLeastOne = Field(
        default=131_072, description="the longest prompt + relayed tokens a continuation re-sends"
    )
    max_kept_tokens: AtLeastOne = Field(
        default=32 * 1024 * 1024,
        description=(
            "relayed token ids kept for all streams (~3 bytes each); "
            "streams past it are not followed"
        ),
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class AdminConfig:
    # HOST:PORT, checked by build_config (a serving process's is its `unix:` control socket)
    listen: Text = Field(
        default="127.0.0.1:50052", description="the admin API's port (non-loopback needs a token)"
    )
    token: Name | None = Field(default=None, description="bearer token the admin API requires")


@functools.cache
def _default_settings(policy: PolicyName) -> ModelSettings:
    """What a model without settings of its own runs with (built once per policy)."""
    return ModelSettings(policy=policy)


@dataclass(frozen=True, slots=True, config=SETTINGS)
class GatewayConfig:
    listen: Text = Field(
        default="127.0.0.1:50051",
        description="the main port: engine services, health, ORCA, reflection",
    )
    workers: tuple[WorkerEntry, ...] = Field(
        default=(),
        description=(
            "static workers: a worker URL, or a mapping with `url` and the URL's query keys"
        ),
    )
    discovery: tuple[DiscoverySource, ...] = Field(
        default=(), description="sources of workers, each a mapping with `source`"
    )
    flow: FlowConfig | None = Field(
        default=None,
        description=(
            "flow control: calls wait in per-model queues instead of "
            "WORKERS_OVERLOADED; absent: off"
        ),
    )
    tenants: Mapping[Name, TenantConfig] = Field(
        default_factory=dict,
        description="per tenant (principal name; `default`: every other tenant)",
    )
    models: Mapping[ModelName, ModelSettings] = Field(
        default_factory=dict, description="per-model settings"
    )
    default_policy: PolicyName = Field(
        default="round_robin", description="the policy of models without one"
    )
    model_headers: tuple[HeaderName, ...] = Field(
        default=("x-model-id", "x-gateway-model-name"),
        description="request headers naming the model; the first one present wins",
    )
    routing_key_header: Name = Field(
        default="x-routing-key", description="the `consistent_hash` key"
    )
    target_worker_header: Name = Field(
        default="x-target-worker",
        description="`HOST:PORT`: the worker for `manual` and fleet-wide RPCs",
    )
    max_attempts: AtLeastOne = Field(
        default=3, description="upstream attempts per call (retries before the first message)"
    )
    retry_after_ms: Whole = Field(
        default=1000, description="RetryInfo / `retry-after` / pushback of retryable verdicts"
    )
    discovery_timeout_s: Seconds = Field(
        default=5.0, description="start-up waits at most this long for workers and sources"
    )
    max_message_bytes: Size = Field(
        default=64 * 1024 * 1024,
        description="largest request or response message, on every port and channel",
    )
    log_format: LogFormat = Field(
        default="console", description="console lines for people, JSON lines for machines"
    )
    log_level: LogLevel = Field(default="info", description="the lowest level logged")
    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)
    outlier_detection: OutlierDetectionConfig = dataclasses.field(
        default_factory=OutlierDetectionConfig
    )
    loads: LoadsConfig = dataclasses.field(default_factory=LoadsConfig)
    drain: DrainConfig = dataclasses.field(default_factory=DrainConfig)
    disagg: DisaggConfig = dataclasses.field(default_factory=DisaggConfig)
    migration: MigrationConfig = dataclasses.field(default_factory=MigrationConfig)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    upstream: UpstreamConfig = dataclasses.field(default_factory=UpstreamConfig)
    tls: TlsConfig = dataclasses.field(default_factory=TlsConfig)
    upstream_tls: UpstreamTlsConfig = dataclasses.field(default_factory=UpstreamTlsConfig)
    auth: AuthConfig = dataclasses.field(default_factory=AuthConfig)
    kv: KvConfig = dataclasses.field(default_factory=KvConfig)
    affinity: AffinityConfig = dataclasses.field(default_factory=AffinityConfig)
    slo: SloConfig = dataclasses.field(default_factory=SloConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    admin: AdminConfig = dataclasses.field(default_factory=AdminConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    tracing: TracingConfig = dataclasses.field(default_factory=TracingConfig)
    orca: OrcaConfig = dataclasses.field(default_factory=OrcaConfig)
    picker: PickerConfig = dataclasses.field(default_factory=PickerConfig)
    state: StateConfig = dataclasses.field(default_factory=StateConfig)
    processes: Processes = Field(
        default=1, description="serving processes sharing the main port (`auto`: usable cores)"
    )

    def model(self, name: str) -> ModelSettings:
        found = self.models.get(name)
        return found if found is not None else _default_settings(self.default_policy)

    def tenant(self, name: str) -> TenantConfig:
        found = self.tenants.get(name) or self.tenants.get("default")
        return found if found is not None else _DEFAULT_TENANT

    def policy_for(self, model: str) -> str:
        return self.model(model).policy


_DEFAULT_TENANT = TenantConfig()


SECTIONS: dict[str, type] = {
    "probe": ProbeConfig,
    "outlier_detection": OutlierDetectionConfig,
    "loads": LoadsConfig,
    "drain": DrainConfig,
    "disagg": DisaggConfig,
    "migration": MigrationConfig,
    "limits": LimitsConfig,
    "upstream": UpstreamConfig,
    "tls": TlsConfig,
    "upstream_tls": UpstreamTlsConfig,
    "auth": AuthConfig,
    "kv": KvConfig,
    "affinity": AffinityConfig,
    "slo": SloConfig,
    "lora": LoraConfig,
    "admin": AdminConfig,
    "metrics": MetricsConfig,
    "tracing": TracingConfig,
    "orca": OrcaConfig,
    "picker": PickerConfig,
    "state": StateConfig,
}
