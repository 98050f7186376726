"""Typed configuration: a YAML file and command-line flags, validated with clear errors.

The settings are frozen pydantic dataclasses: every field's type and bounds are declared
once, next to its default, and checked whether the value comes from the file, from a flag
(`build_config` merges the flags into the file's data before validating) or from code
(`dataclasses.replace` and the constructors validate too). Every problem raises
`ConfigError` with one line that names the bad value by its path in the file
(`limits.max_choices: must be at least 1, not 0`, `workers[0].role: ...`); the CLI
prints it and exits with status 2.

This package's root is its API: what the rest of the tree imports. The modules hold one
section each (workers, models, upstream, limits, kv, affinity, security, observability,
discovery, flow), the field types (fields), `GatewayConfig` and `SECTIONS` (gateway), reading,
merging and the one-line errors (loading, errors), and the models a config serves and declares
(served).
"""

from gateway.config.addresses import parse_address
from gateway.config.affinity import AffinityConfig
from gateway.config.discovery import (
    DiscoverySource,
    DnsDiscovery,
    FileDiscovery,
    KubernetesDiscovery,
)
from gateway.config.errors import ConfigError
from gateway.config.fields import MAX_NAME
from gateway.config.flow import (
    DEFAULT_COST_TOKENS,
    DEFAULT_TENANT_LABELS,
    FlowClassConfig,
    FlowConfig,
    TenantConfig,
)
from gateway.config.gateway import SECTIONS, AdminConfig, GatewayConfig
from gateway.config.kv import KvConfig
from gateway.config.limits import LimitsConfig
from gateway.config.loading import (
    build_config,
    load_file,
    parse_worker_list,
    parse_worker_url,
    warn_renamed,
)
from gateway.config.models import ModelSettings, Route, named_models, route_problem, routes_of
from gateway.config.observability import (
    LOG_FORMATS,
    LOG_LEVELS,
    MetricsConfig,
    OrcaConfig,
    TracingConfig,
)
from gateway.config.picker import DESTINATION_HEADER, PickerConfig, picker_tls
from gateway.config.processes import parse_processes, usable_cores
from gateway.config.security import AuthConfig, TlsConfig, UpstreamTlsConfig
from gateway.config.served import Declared, declared_models, route_targets, served_models
from gateway.config.slo import DEFAULT_PRIORITY_HEADER, SloConfig
from gateway.config.state import StateConfig
from gateway.config.upstream import LoadsConfig, OutlierDetectionConfig, ProbeConfig, UpstreamConfig
from gateway.config.workers import WORKER_URL_KEYS, WorkerSpec
from gateway.core.policy_names import POLICIES  # the built-in policies (plugins: policy_names())

__all__ = [
    "DEFAULT_COST_TOKENS",
    "DEFAULT_PRIORITY_HEADER",
    "DEFAULT_TENANT_LABELS",
    "DESTINATION_HEADER",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_NAME",
    "POLICIES",
    "SECTIONS",
    "WORKER_URL_KEYS",
    "AdminConfig",
    "AffinityConfig",
    "AuthConfig",
    "ConfigError",
    "Declared",
    "DiscoverySource",
    "DnsDiscovery",
    "FileDiscovery",
    "FlowClassConfig",
    "FlowConfig",
    "GatewayConfig",
    "KubernetesDiscovery",
    "KvConfig",
    "LimitsConfig",
    "LoadsConfig",
    "MetricsConfig",
    "ModelSettings",
    "OrcaConfig",
    "OutlierDetectionConfig",
    "PickerConfig",
    "ProbeConfig",
    "Route",
    "SloConfig",
    "StateConfig",
    "TenantConfig",
    "TlsConfig",
    "TracingConfig",
    "UpstreamConfig",
    "UpstreamTlsConfig",
    "WorkerSpec",
    "build_config",
    "declared_models",
    "load_file",
    "named_models",
    "parse_address",
    "parse_processes",
    "parse_worker_list",
    "parse_worker_url",
    "picker_tls",
    "route_problem",
    "route_targets",
    "routes_of",
    "served_models",
    "usable_cores",
    "warn_renamed",
]
