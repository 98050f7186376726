"""What a reload applies (gateway.config.reload): the file's values of the keys that
reload, the running values of the rest (listed), switches on or off left for a restart."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, build_config
from gateway.config.reload import reload, reloads


def test_a_key_reloads_with_everything_under_it() -> None:
    assert reloads("models.<model>.route[].weight")
    assert reloads("flow.classes[].ttl_s")
    assert reloads("tenants.<tenant>.weight")
    assert not reloads("flow")
    assert not reloads("limits.max_connections")
    assert not reloads("listen")


def test_the_file_wins_for_keys_that_reload_and_the_running_config_for_the_rest() -> None:
    running = build_config({"max_attempts": 3, "limits": {"max_connections": 10}})
    read = build_config({"max_attempts": 1, "limits": {"max_connections": 5, "max_choices": 4}})
    done = reload(running, read)
    assert done.config.max_attempts == 1 and done.config.limits.max_choices == 4
    assert done.config.limits.max_connections == 10
    assert done.applied == ("max_attempts", "limits.max_choices")
    assert done.need_restart == ("limits.max_connections",)


def test_turning_a_part_on_or_off_needs_a_restart() -> None:
    running = build_config({"affinity": {"header": "x-session"}})
    read = build_config({"affinity": {"header": None, "ttl_s": 5}, "flow": {}})
    done = reload(running, read)
    assert done.config.affinity.header == "x-session" and done.config.affinity.ttl_s == 5
    assert done.config.flow is None
    assert set(done.need_restart) == {"flow", "affinity.header"}


def test_nothing_changed_is_nothing_applied() -> None:
    running = build_config({"max_attempts": 2})
    done = reload(running, build_config({"max_attempts": 2}))
    assert done.config is running and not done.applied and not done.need_restart


def test_a_mixture_that_breaks_a_rule_between_sections_is_refused() -> None:
    running = build_config({})
    read = build_config(
        {
            "workers": ["grpc://127.0.0.1:1?model=new"],
            "models": {"chat": {"route": [{"model": "new", "weight": 1}]}},
        }
    )
    with pytest.raises(ConfigError, match="new"):
        reload(running, read)  # the route's target comes with a worker only a restart adds
