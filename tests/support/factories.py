"""Builders for what the unit tests construct often: each makes the dependencies that
production code receives from its builder (a worker's outlier detector), so a test names
only what it is about."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from gateway.config import Declared, KvConfig, ModelSettings, OutlierDetectionConfig, WorkerSpec
from gateway.core.roles import Role, Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.placement.affinity import Affinity
from gateway.placement.placer import Placer
from gateway.placement.policies import build_policy
from gateway.upstream.cluster import ClusterMaker, PolicyContext
from gateway.upstream.registry import Registry
from gateway.upstream.signals.outlier import OutlierDetector
from gateway.upstream.worker import Worker


def make_worker(
    spec: WorkerSpec,
    model: str = "m",
    runtime: Runtime = Runtime.SGLANG,
    *,
    role: Role = Role.REGULAR,
    pairing: str = "",
    outlier: OutlierDetectionConfig | None = None,
) -> Worker:
    """A worker as the fleet registers one, with its own outlier detector (from `outlier`, the
    default settings unless given)."""
    return Worker(
        spec=spec,
        model=model,
        runtime=runtime,
        outlier=OutlierDetector(outlier if outlier is not None else OutlierDetectionConfig()),
        role=role,
        pairing=pairing,
    )


def worker_on(
    port: int = 1,
    model: str = "m",
    runtime: Runtime = Runtime.SGLANG,
    *,
    host: str = "h",
    role: Role = Role.REGULAR,
) -> Worker:
    """A worker at `host:port` for `model`: the usual one of a unit test."""
    return make_worker(WorkerSpec(host, port, model, runtime, role), model, runtime, role=role)


def make_registry(
    model_settings: Callable[[str], ModelSettings] = lambda model: ModelSettings(),
    kv_index: KvIndex | None = None,
    stale_after_s: float = 3.0,
) -> Registry:
    """A registry whose clusters take each model's policy and limits from
    `model_settings` (round robin, no limits unless given)."""
    index = kv_index if kv_index is not None else KvIndex()
    context = PolicyContext(index, KvConfig(), stale_after_s)
    return Registry(ClusterMaker(model_settings, build_policy, context))


def make_placer(
    registry: Registry,
    model_settings: Callable[[str], ModelSettings] = lambda model: ModelSettings(),
    *,
    retry_after_ms: int = 1000,
    load_interval_s: float = 1.0,
    stale_after_s: float = 3.0,
    affinity: Affinity | None = None,
    declared: Declared = MappingProxyType({}),
) -> Placer:
    """A placer over `registry` (`model_settings`: which models need the encode leg;
    `affinity`: session bindings, none unless given; `declared`: the models the
    configuration names, none unless given)."""
    return Placer(
        registry,
        model_settings,
        retry_after_ms=retry_after_ms,
        load_interval_s=load_interval_s,
        stale_after_s=stale_after_s,
        adapters=engine_adapters(),
        affinity=affinity,
        declared=declared,
    )
