"""The policy names are in one table (gateway/core/policy_names.py): the config validates
against it, the CLI offers it, and placement builds a policy under every name."""

from __future__ import annotations

from gateway import config
from gateway.config import KvConfig
from gateway.core.policy_names import POLICIES, policy_names
from gateway.core.roles import Role
from gateway.kv.index import KvIndex
from gateway.placement.policies import Policy, PolicyContext, build_policy, policy_class
from tests.support.policies import cli_policy_choices


def test_placement_has_a_policy_under_every_built_in_name() -> None:
    context = PolicyContext(KvIndex(), KvConfig(), 3.0)
    assert len(set(POLICIES)) == len(POLICIES)
    for name in POLICIES:
        cls = policy_class(name)
        assert issubclass(cls, Policy) and cls.name == name
        built = build_policy(name, Role.REGULAR, context)
        assert type(built) is cls


def test_the_config_and_the_cli_use_the_same_list() -> None:
    assert config.POLICIES is POLICIES
    assert policy_names()[: len(POLICIES)] == POLICIES
    assert cli_policy_choices() == policy_names()


def test_every_name_is_a_valid_policy_in_the_config() -> None:
    for name in POLICIES:
        built = config.build_config({"default_policy": name, "models": {"m": {"policy": name}}})
        assert built.policy_for("m") == built.policy_for("other") == name
