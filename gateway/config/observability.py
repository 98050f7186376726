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
