"""The worker side: active probes, outlier detection, load polls, channel keepalive."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, Strict
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Interval, Seconds, Size


@dataclass(frozen=True, slots=True, config=SETTINGS)
class ProbeConfig:
    interval_s: Interval = Field(
        default=1.0, description="grpc.health probe of every worker this often"
    )
    timeout_s: Interval = Field(default=1.0, description="a probe's deadline")
    success_threshold: AtLeastOne = Field(
        default=2, description="good probes in a row that bring a worker back"
    )
    failure_threshold: AtLeastOne = Field(
        default=2, description="failed probes in a row (timeouts, errors) that take it out"
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class OutlierDetectionConfig:
    """`outlier_detection:` (formerly `breaker:`): `failure_threshold` consecutive failed
    requests eject a worker for `cooldown_s`; then one trial request at a time, and
    `success_threshold` trial successes in a row put it back (see signals/outlier.py)."""

    failure_threshold: AtLeastOne = Field(
        default=5, description="failed calls in a row that eject a worker"
    )
    cooldown_s: Seconds = Field(
        default=5.0, description="ejected this long, then one trial call at a time"
    )
    success_threshold: AtLeastOne = Field(
        default=2, description="trial successes in a row that bring it back"
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class LoadsConfig:
    interval_s: Interval = Field(
        default=1.0,
        description=(
            "`GetLoads` poll of every worker this often (a report is trusted for 3 intervals)"
        ),
    )
    timeout_s: Interval = Field(default=1.0, description="a poll's deadline")

    @property
    def stale_after_s(self) -> float:
        """A load report older than this is not trusted (three missed polls)."""
        return 3 * self.interval_s


@dataclass(frozen=True, slots=True, config=SETTINGS)
class UpstreamConfig:
    """HTTP/2 keepalive on worker channels: a worker that stops answering pings (frozen,
    or its host gone without a FIN) has its connection closed after `keepalive_time_s`
    + `keepalive_timeout_s`, and its calls fail over. Workers must accept pings that often
    (see docs/configuration.md); 0 turns keepalive off."""

    keepalive_time_s: Seconds = Field(
        default=10.0, description="HTTP/2 ping on a silent worker connection this often; 0: off"
    )
    keepalive_timeout_s: Seconds = Field(
        default=5.0, description="an unanswered ping closes the connection after this"
    )
    # What a worker may send ahead on one stream before the gateway's client reads it:
    # the fixed HTTP/2 stream window of worker channels (grpc's default grows to 4 MiB).
    stream_window_bytes: Size = Field(
        default=256 * 1024, description="what a worker may send ahead on one stream (HTTP/2 window)"
    )
    # A worker's response headers, and its trailers, as relayed to the client: at most this
    # many entries of at most this many bytes in all (HTTP/2's count: key + value + 32 per
    # entry), the rest dropped; clients refuse a block over 8 KiB at random (grpc's soft
    # limit), and the gateway's own trailers and the status message go in the same block.
    max_relayed_metadata_bytes: Annotated[int, Strict(), Field(ge=0, le=16384)] = Field(
        default=4096, description="a worker's headers, and its trailers, relayed up to this size"
    )
    max_relayed_metadata_entries: Annotated[int, Strict(), Field(ge=0, le=1024)] = Field(
        default=64, description="... and up to this many entries"
    )
