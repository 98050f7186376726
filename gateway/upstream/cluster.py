"""A cluster: the workers (hosts) of one model, runtime and role, and what decides among
them: its load-balancing policy and its per-worker limits (Envoy's vocabulary).

Workers enter and leave a cluster only through the registry, whose door is the fleet's
`add`/`remove` (static configuration and the admin API both use it). The cluster keeps
its workers as an immutable, id-sorted tuple, replaced on every change: a placement reads
one consistent snapshot, and policies rotate by id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import KvConfig, ModelSettings
from gateway.core.roles import Role, Runtime
from gateway.kv.index import KvIndex
from gateway.upstream.cache_aware import CacheAware
from gateway.upstream.load.limits import Limits
from gateway.upstream.policies import LeastInflight, Policy, make_policy
from gateway.upstream.worker import Worker


@dataclass(frozen=True, slots=True)
class ClusterKey:
    model: str
    runtime: Runtime
    role: Role


class Cluster:
    """One leg's workers of one model on one runtime; one policy instance per cluster, so
    legs never share a rotation."""

    __slots__ = ("key", "limits", "policy", "workers")

    def __init__(self, key: ClusterKey, policy: Policy, limits: Limits) -> None:
        self.key = key
        self.policy = policy
        self.limits = limits
        self.workers: tuple[Worker, ...] = ()

    def admit(self, worker: Worker) -> None:
        self.workers = tuple(sorted((*self.workers, worker), key=lambda w: w.id))

    def evict(self, worker: Worker) -> None:
        self.workers = tuple(w for w in self.workers if w is not worker)

    def __repr__(self) -> str:
        key = self.key
        return f"Cluster({key.model}/{key.runtime}/{key.role} {len(self.workers)} workers)"


ClusterFactory = Callable[[ClusterKey], Cluster]


def cluster_factory(
    model_settings: Callable[[str], ModelSettings],
    kv_index: KvIndex,
    kv_settings: KvConfig,
    stale_after_s: float,
    stale_saturates: bool = False,
) -> ClusterFactory:
    """How the registry makes a cluster: the model's policy and limits (a cache-aware
    model's decode leg goes by load: the prompt's cache is the prefill's)."""

    def make(key: ClusterKey) -> Cluster:
        model = model_settings(key.model)
        policy: Policy
        if model.policy != CacheAware.name:
            policy = make_policy(model.policy)
        elif key.role is Role.DECODE:
            policy = LeastInflight()
        else:
            policy = CacheAware(kv_index, kv_settings, stale_after_s)
        limits = Limits(
            model.max_inflight, model.max_waiting, model.max_token_usage, stale_saturates
        )
        return Cluster(key, policy, limits)

    return make
