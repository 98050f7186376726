"""`affinity:`: off unless its header is set; bounds refused in one line."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, build_config


def test_affinity_is_off_by_default_and_on_with_a_header() -> None:
    assert not build_config({}).affinity.enabled
    config = build_config({"affinity": {"header": "X-Session-Id", "max_sessions": 10}})
    assert config.affinity.enabled
    assert (config.affinity.header, config.affinity.ttl_s) == ("x-session-id", 600.0)
    assert config.affinity.max_sessions == 10


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"max_sessions": 0}, "affinity.max_sessions: must be at least 1, not 0"),
        ({"ttl_s": 0}, "affinity.ttl_s: must be greater than 0, not 0"),
        ({"header": ""}, "affinity.header: must not be empty"),
        ({"session": "x"}, "affinity: unknown key 'session' (known: header, ttl_s, max_sessions)"),
    ],
)
def test_bad_affinity_settings_are_one_line_errors(
    section: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        build_config({"affinity": section})
    assert str(raised.value) == message
