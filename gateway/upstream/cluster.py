"""A cluster: the workers (hosts) of one model, runtime and role, and what decides among
them: its load-balancing policy and its per-worker limits (Envoy's vocabulary).

Workers enter and leave a cluster only through the registry, whose door is the fleet's
`add`/`remove` (static configuration and the admin API both use it). The cluster keeps
its workers as an immutable, id-sorted tuple, replaced on every change: a placement reads
one consistent snapshot, and policies rotate by id.

The policies themselves are placement's (`gateway.placement.policies`), a layer above
this one: a cluster holds its policy as a `ClusterPolicy` (all the fleet needs of it is
its name), and the fleet is handed the `PolicyBuilder` that makes one by the assembly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.config import KvConfig, ModelSettings
from gateway.core.roles import Role, Runtime
from gateway.kv.index import KvIndex
from gateway.upstream.load.limits import WorkerLimits
from gateway.upstream.worker import Worker


class ClusterPolicy(Protocol):
    """A cluster's policy as the fleet sees it; placement, which built it, calls it."""

    @property
    def name(self) -> str: ...


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What every policy is built with (`Policy.build`), built-in or plugin: the fleet's
    KV index (what the workers hold cached), the `kv:` settings, and how old a worker's
    load report may be before it no longer counts (`loads.stale_after_s`)."""

    kv_index: KvIndex
    kv: KvConfig
    stale_after_s: float


# (the model's policy name, the cluster's role, the context) -> a new policy instance.
PolicyBuilder = Callable[[str, Role, PolicyContext], ClusterPolicy]


@dataclass(frozen=True, slots=True)
class ClusterKey:
    model: str
    runtime: Runtime
    role: Role


class Cluster:
    """One leg's workers of one model on one runtime; one policy instance per cluster, so
    legs never share a rotation."""

    __slots__ = ("key", "limits", "policy", "workers")

    def __init__(self, key: ClusterKey, policy: ClusterPolicy, limits: WorkerLimits) -> None:
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


class ClusterMaker:
    """How the registry makes a cluster: a policy of its own, by the model's policy name
    and the cluster's role (`build_policy`), and the model's limits; and how a reload
    brings a cluster to the model's settings now (`refresh`)."""

    def __init__(
        self,
        model_settings: Callable[[str], ModelSettings],
        build_policy: PolicyBuilder,
        context: PolicyContext,
        stale_saturates: bool = False,
    ) -> None:
        self._model_settings = model_settings
        self._build_policy = build_policy
        self._context = context
        self._stale_saturates = stale_saturates

    def __call__(self, key: ClusterKey) -> Cluster:
        model = self._model_settings(key.model)
        policy = self._build_policy(model.policy, key.role, self._context)
        return Cluster(key, policy, self._limits(key, model))

    def refresh(self, cluster: Cluster) -> bool:
        """The model's limits now, and a new policy if its name changed (a policy keeps
        its rotation and shares while it stays): True if the policy was replaced."""
        model = self._model_settings(cluster.key.model)
        cluster.limits = self._limits(cluster.key, model)
        if cluster.policy.name == model.policy:
            return False
        cluster.policy = self._build_policy(model.policy, cluster.key.role, self._context)
        return True

    def _limits(self, key: ClusterKey, model: ModelSettings) -> WorkerLimits:
        return WorkerLimits(
            model.max_inflight,
            model.max_waiting,
            model.max_token_usage,
            self._stale_saturates,
            within_window=key.role is Role.DECODE,
        )
