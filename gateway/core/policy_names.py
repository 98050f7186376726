"""The names of the placement policies, written once.

The config validates `default_policy` and each model's `policy` against them and the CLI
offers them as `--policy` choices; each policy class in `gateway.placement` is registered
under one of them (`tests/unit/test_config_policies.py` checks the two agree). A module of
its own with no imports from the gateway: config is a low layer, and placement imports it.
"""

from __future__ import annotations

from typing import Literal, get_args

PolicyName = Literal[
    "round_robin",
    "random",
    "power_of_two",
    "least_inflight",
    "consistent_hash",
    "manual",
    "cache_aware",
]
POLICIES: tuple[PolicyName, ...] = get_args(PolicyName)
