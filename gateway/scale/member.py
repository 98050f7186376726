"""Where a serving process stands among its siblings: its index, their count, and the
private directory where each one's control socket lives."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from gateway.config import AdminConfig, GatewayConfig, MetricsConfig, WorkerSpec


@dataclass(frozen=True, slots=True)
class Member:
    """One serving process of `gateway serve --processes N` (index 0..count-1)."""

    index: int
    count: int
    control_dir: str  # mode 0700, made by the supervisor: only the gateway's user gets in

    def socket_path(self, index: int) -> Path:
        return Path(self.control_dir) / f"p{index}.sock"

    def control_address(self, index: int | None = None) -> str:
        """The gRPC address of a process's control socket (admin and peer services)."""
        return f"unix:{self.socket_path(self.index if index is None else index)}"

    def siblings(self) -> list[str]:
        """The other processes' control addresses."""
        return [self.control_address(i) for i in range(self.count) if i != self.index]

    def share(self, limit: int) -> int:
        """This process's share of a limit: the shares add up to at least the limit and to
        at most limit + count - 1 (a positive limit gives each at least 1; 0 stays 0)."""
        return -(-limit // self.count)


def serving_config(
    config: GatewayConfig, member: Member, port: int, workers: Iterable[WorkerSpec]
) -> GatewayConfig:
    """What a serving process runs with: the main port the supervisor holds, its control
    socket for the admin API (no token: only the gateway's user can open it), no metrics
    endpoint of its own, the fleet as the admin API left it, and its share of every bound
    that counts the gateway's own calls, reads or connections (gateway-wide, per caller or
    per worker), so that N processes together stay within the configured numbers (plus
    at most N - 1)."""
    host, limits = config.listen.rpartition(":")[0], config.limits
    models = {
        name: replace(settings, max_inflight=member.share(settings.max_inflight))
        if settings.max_inflight is not None
        else settings
        for name, settings in config.models.items()
    }
    return replace(
        config,
        listen=f"{host}:{port}",
        workers=tuple(workers),
        models=models,
        limits=replace(
            limits,
            max_inflight_requests=member.share(limits.max_inflight_requests),
            max_inflight_per_principal=member.share(limits.principal_share),
            max_request_reads=member.share(limits.max_request_reads),
            max_request_reads_per_peer=member.share(limits.max_request_reads_per_peer),
            max_connections=member.share(limits.max_connections),
            max_connections_per_peer=member.share(limits.max_connections_per_peer),
        ),
        admin=AdminConfig(listen=member.control_address(), token=None),
        metrics=MetricsConfig(listen=None),
        processes=1,
    )
