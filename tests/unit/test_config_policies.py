"""The policy names are written once (gateway/core/policy_names.py): the config validates
against them, the CLI offers them, and placement has one policy under each."""

from __future__ import annotations

import argparse
from typing import get_args

from gateway import config
from gateway.cli.main import build_parser
from gateway.core.policy_names import POLICIES, PolicyName
from gateway.upstream.cache_aware import CacheAware
from gateway.upstream.policies import POLICY_TYPES


def test_placement_has_a_policy_under_every_name_and_no_other() -> None:
    assert sorted([*POLICY_TYPES, CacheAware.name]) == sorted(POLICIES)
    assert len(set(POLICIES)) == len(POLICIES)


def test_the_config_and_the_cli_use_the_same_list() -> None:
    assert config.POLICIES is POLICIES
    assert get_args(PolicyName) == POLICIES
    serve = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ).choices["serve"]
    policy = next(a for a in serve._actions if a.dest == "policy")
    assert tuple(policy.choices or ()) == POLICIES


def test_every_name_is_a_valid_policy_in_the_config() -> None:
    for name in POLICIES:
        built = config.build_config({"default_policy": name, "models": {"m": {"policy": name}}})
        assert built.policy_for("m") == built.policy_for("other") == name
