"""Logs, metrics, tracing and ORCA load reports."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, Field, Strict
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Flag, Interval, Text

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["console", "json"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)  # `log_level:` and --log-level alike
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)


def _off_is_none(value: Any) -> Any:
    return None if value == "off" else value


MetricsListen = Annotated[Text | None, BeforeValidator(_off_is_none)]


@dataclass(frozen=True, slots=True, config=SETTINGS)
class TracingConfig:
    """OpenTelemetry traces over OTLP/gRPC (see docs/observability.md): on when an
    endpoint is set here or in OTEL_EXPORTER_OTLP_TRACES_ENDPOINT/OTEL_EXPORTER_OTLP_ENDPOINT;
    what is not set here comes from the standard OTEL_* variables."""

    # e.g. http://collector:4317 (http: plaintext)
    endpoint: Text | None = Field(
        default=None,
        description=(
            "OTLP/gRPC collector; null: `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`, else tracing off"
        ),
    )
    # None: from the endpoint's scheme, or the environment
    insecure: Flag | None = Field(
        default=None, description="plaintext to the collector; null: from the endpoint's scheme"
    )
    sample_ratio: Annotated[float, Strict(), Field(ge=0, le=1)] | None = Field(
        default=None,
        description="parent-based ratio; null: `OTEL_TRACES_SAMPLER(_ARG)`, else all",
    )
    service_name: Text | None = Field(
        default=None, description="null: `OTEL_SERVICE_NAME`, else `model-gateway`"
    )
    max_queue: AtLeastOne = Field(
        default=2048, description="spans waiting for export; past it the oldest are dropped"
    )
    batch_size: AtLeastOne = Field(default=512, description="spans per export")
    schedule_delay_ms: AtLeastOne = Field(default=1000, description="export at least this often")
    export_timeout_s: Interval = Field(default=10.0, description="an export's deadline")


@dataclass(frozen=True, slots=True, config=SETTINGS)
class MetricsConfig:
    # "off": None, no endpoint
    listen: MetricsListen = Field(
        default="127.0.0.1:9464", description="Prometheus `/metrics` endpoint; `off`: none"
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class OrcaConfig:
    """ORCA load reports of each serving process (gateway/orca). `trailers`: every engine
    call's trailers end with `endpoint-load-metrics-bin`; `min_interval_s`: the shortest
    interval a StreamCoreMetrics stream gets, whatever it asks; `max_streams`: those
    streams open at once, per serving process; `max_streams_per_connection`: those one
    client connection may hold; `max_streams_per_peer`: those one principal (API key,
    client certificate, else peer address) may hold, None: a quarter of `max_streams`."""

    trailers: Flag = Field(
        default=True,
        description="end every engine call's trailers with `endpoint-load-metrics-bin`",
    )
    min_interval_s: Interval = Field(
        default=1.0, description="shortest interval a `StreamCoreMetrics` stream gets"
    )
    max_streams: AtLeastOne = Field(default=256, description="`StreamCoreMetrics` streams at once")
    max_streams_per_connection: AtLeastOne = Field(
        default=4, description="... on one client connection"
    )
    max_streams_per_peer: AtLeastOne | None = Field(
        default=None, description="... of one principal or address (null: `max_streams` / 4)"
    )

    @property
    def peer_share(self) -> int:
        """The streams one principal or peer may hold: configured, else a quarter."""
        if self.max_streams_per_peer is not None:
            return self.max_streams_per_peer
        return max(1, self.max_streams // 4)
