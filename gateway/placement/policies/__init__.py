"""Placement policies, one module each, found by name (`registry`).

A custom policy is a `Policy` subclass in an installed distribution that declares it in
the entry point group `grpc_model_gateway.policies` (`name = "module:Class"`); the
config then takes `name` as `default_policy` or a model's `policy` (docs/routing.md, "Policies").
This package's root is what a plugin imports.
"""

from gateway.placement.policies.base import (
    C,
    Candidate,
    Choice,
    Hints,
    Policy,
    PolicyContext,
    Unattainable,
    rendezvous_pick,
    rotate_after,
)
from gateway.placement.policies.registry import build_policy, policy_class

__all__ = [
    "C",
    "Candidate",
    "Choice",
    "Hints",
    "Policy",
    "PolicyContext",
    "Unattainable",
    "build_policy",
    "policy_class",
    "rendezvous_pick",
    "rotate_after",
]
