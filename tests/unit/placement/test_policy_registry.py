"""Policies by name: built-ins and installed plugins (entry point group
`grpc_model_gateway.policies`) through one table, loaded when the config names them, and
every problem with one a one-line config error."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import ConfigError, KvConfig, build_config
from gateway.core import policy_names
from gateway.core.roles import Role
from gateway.kv.index import KvIndex
from gateway.placement.policies import Hints, PolicyContext, build_policy, policy_class
from gateway.placement.policies.cache_aware import CacheAware
from gateway.placement.policies.least_inflight import LeastInflight
from gateway.placement.policies.predicted_latency import PacedDecode, PredictedLatency
from gateway.placement.policies.registry import leg_policy
from tests.support.policies import C, cli_policy_choices
from tests.support.policy_plugin import LAST_ID, write_plugin

BUILT_IN = (
    "round_robin|random|power_of_two|least_inflight|consistent_hash|manual|cache_aware"
    "|predicted_latency"
)
MODULES = ("last_id_policy", "broken_policy", "not_a_class")


def forget() -> None:
    """Read the entry points and load the classes afresh (both are cached per process)."""
    policy_names.table.cache_clear()
    policy_names.load.cache_clear()
    importlib.invalidate_caches()


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on the path for the test's plugin distributions."""
    monkeypatch.syspath_prepend(str(tmp_path))
    forget()
    yield tmp_path
    for module in MODULES:
        sys.modules.pop(module, None)
    forget()


def install_last_id(directory: Path) -> None:
    write_plugin(
        directory,
        "last-id-policy",
        {"last_id": "last_id_policy:LastId"},
        {"last_id_policy": LAST_ID},
    )


def problem(data: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as caught:
        build_config(data)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_an_unknown_name_is_a_config_error_naming_the_known_ones() -> None:
    assert problem({"models": {"m": {"policy": "fastest"}}}) == (
        f"models.m.policy: unknown policy 'fastest' (expected {BUILT_IN})"
    )
    assert problem({"default_policy": "fastest"}) == (
        f"default_policy: unknown policy 'fastest' (expected {BUILT_IN})"
    )


def test_an_installed_plugin_is_a_policy_by_name(plugins: Path) -> None:
    install_last_id(plugins)
    assert policy_names.policy_names() == (*policy_names.POLICIES, "last_id")
    assert "last_id" in cli_policy_choices()
    assert "last_id_policy" not in sys.modules  # listed, not loaded: nothing names it yet
    built = build_config({"default_policy": "last_id", "models": {"m": {}, "n": {}}})
    assert built.policy_for("m") == built.policy_for("n") == built.policy_for("x") == "last_id"
    assert "last_id_policy" in sys.modules  # the config named it: loaded and checked
    policy = build_policy("last_id", Role.REGULAR, PolicyContext(KvIndex(), KvConfig(), 3.0))
    assert type(policy) is policy_class("last_id")
    pool = [C("a", inflight=5), C("c", inflight=9), C("b")]
    assert [policy.pick(pool, Hints()) for _ in range(3)] == [C("c", inflight=9)] * 3


def test_an_unknown_name_lists_the_installed_plugins_too(plugins: Path) -> None:
    install_last_id(plugins)
    assert problem({"models": {"m": {"policy": "fastest"}}}).endswith(
        f"(expected {BUILT_IN}|last_id)"
    )


def test_a_plugin_that_fails_to_import_is_a_one_line_config_error(plugins: Path) -> None:
    write_plugin(
        plugins,
        "broken-policy",
        {"broken": "broken_policy:Broken", "missing": "nowhere_at_all:Policy"},
        {"broken_policy": "import nothing_by_this_name\n"},
    )
    assert problem({"models": {"m": {"policy": "broken"}}}) == (
        "models.m.policy: policy 'broken' (broken_policy:Broken from broken-policy) cannot be"
        " loaded: ModuleNotFoundError: No module named 'nothing_by_this_name'"
    )
    assert problem({"default_policy": "missing"}).startswith(
        "default_policy: policy 'missing' (nowhere_at_all:Policy from broken-policy) cannot be"
        " loaded: ModuleNotFoundError"
    )
    # Unnamed, a broken plugin is never imported: the config that does not use it loads.
    assert build_config({"models": {"m": {"policy": "round_robin"}}}).policy_for("m")


def test_a_plugin_that_is_not_a_policy_class_is_a_config_error(plugins: Path) -> None:
    write_plugin(
        plugins, "odd-policy", {"odd": "not_a_class:odd"}, {"not_a_class": "def odd():\n    pass\n"}
    )
    assert problem({"models": {"m": {"policy": "odd"}}}) == (
        "models.m.policy: policy 'odd' (not_a_class:odd from odd-policy) is not a policy class"
        " (subclass gateway.placement.policies.Policy)"
    )


def test_a_plugin_cannot_take_a_built_in_name(plugins: Path) -> None:
    write_plugin(
        plugins,
        "shadow-policy",
        {"round_robin": "last_id_policy:LastId"},
        {"last_id_policy": LAST_ID},
    )
    assert problem({"models": {"m": {"policy": "round_robin"}}}) == (
        "models.m.policy: policy 'round_robin' is declared more than once"
        " (gateway.placement.policies.round_robin:RoundRobin,"
        " last_id_policy:LastId from shadow-policy)"
    )


def test_a_cache_aware_models_decode_leg_goes_by_load() -> None:
    assert leg_policy("cache_aware", Role.DECODE) is LeastInflight
    assert leg_policy("cache_aware", Role.PREFILL) is CacheAware
    assert leg_policy("round_robin", Role.DECODE).name == "round_robin"
    assert leg_policy("predicted_latency", Role.DECODE) is PacedDecode
    assert leg_policy("predicted_latency", Role.PREFILL) is PredictedLatency
    context = PolicyContext(KvIndex(), KvConfig(), 3.0)
    assert type(build_policy("cache_aware", Role.DECODE, context)) is LeastInflight
    aware = build_policy("cache_aware", Role.REGULAR, context)
    assert isinstance(aware, CacheAware) and aware.index is context.kv_index
