"""What the supervisor gives each serving process: its place among its siblings
(`Member`, defined in the leaf module `gateway.core.member` so that the serving process can
read it without importing the supervisor's package) and its configuration."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from gateway.config import AdminConfig, GatewayConfig, MetricsConfig, WorkerSpec
from gateway.core.member import Member as Member  # re-exported: supervisor and child use it


def serving_config(
    config: GatewayConfig,
    member: Member,
    port: int,
    workers: Iterable[WorkerSpec],
    picker_port: int = 0,
) -> GatewayConfig:
    """What a serving process runs with: the main port the supervisor holds, its control
    socket for the admin API (no token: only the gateway's user can open it), no metrics
    endpoint of its own, the fleet as the admin API left it, and its share of every bound
    that counts the gateway's own calls, reads or connections (gateway-wide, per caller or
    per worker), so that N processes together stay within the configured numbers (plus
    at most N - 1); with the endpoint picker on, the picker's port the supervisor holds."""
    host, limits = config.listen.rpartition(":")[0], config.limits
    picker_host = (config.picker.listen or "").rpartition(":")[0]
    models = {
        name: replace(settings, max_inflight=member.share(settings.max_inflight))
        if settings.max_inflight is not None
        else settings
        for name, settings in config.models.items()
    }
    # With a shared store the budgets are the fleet's, charged there whole by every process.
    split = not config.state.enabled
    tenants = {name: t.shared(member.share, split) for name, t in config.tenants.items()}
    flow = config.flow
    if flow is not None:  # each process's queues hold its share
        queue = replace(
            flow.queue,
            max_requests=member.share(flow.queue.max_requests),
            max_bytes=member.share(flow.queue.max_bytes),
        )
        flow = replace(flow, queue=queue)
    return replace(
        config,
        listen=f"{host}:{port}",
        workers=tuple(workers),
        models=models,
        tenants=tenants,
        flow=flow,
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
        picker=replace(config.picker, listen=f"{picker_host}:{picker_port}")
        if config.picker.listen is not None
        else config.picker,
        processes=1,
    )
