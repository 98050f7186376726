"""Policies by name: the class behind a name (`gateway.core.policy_names`: the built-in
table and the installed plugins' entry points) and one instance built per cluster.

Built-ins and plugins go the same way: `Class.build(context)`, with the fleet's
`PolicyContext` (the KV index, the `kv:` settings, the load reports' staleness bound).
"""

from __future__ import annotations

from typing import cast

from gateway.core import policy_names
from gateway.core.roles import Role
from gateway.placement.policies.base import Policy, PolicyContext
from gateway.placement.policies.cache_aware import CacheAware
from gateway.placement.policies.least_inflight import LeastInflight
from gateway.placement.policies.predicted_latency import PacedDecode, PredictedLatency


def policy_class(name: str) -> type[Policy]:
    """The class registered under `name`, loaded on first use (PolicyError, one line, if
    it cannot be; the config checked a plugin's already)."""
    # policy_names checked it has `build` and `choose`, all that placement calls.
    return cast("type[Policy]", policy_names.load(name))


def leg_policy(name: str, role: Role) -> type[Policy]:
    """The policy a leg of a model with policy `name` goes by: a cache-aware model's
    decode leg goes by load (the prompt's cache is the prefill's), a predicted-latency
    model's by its workers' predicted time per output token."""
    if role is Role.DECODE and name == CacheAware.name:
        return LeastInflight
    if role is Role.DECODE and name == PredictedLatency.name:
        return PacedDecode
    return policy_class(name)


def build_policy(name: str, role: Role, context: PolicyContext) -> Policy:
    """A new policy for one cluster (the fleet's `PolicyBuilder`)."""
    return leg_policy(name, role).build(context)
