"""Renamed configuration keys: `breaker:` is now `outlier_detection:` (Envoy's name for
ejecting a worker that keeps failing). The old key is still read for one release, with one
warning; a file that gives both is refused."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from gateway.config import ConfigError, OutlierDetectionConfig, build_config, warn_renamed
from gateway.config.loading import renamed_keys

SETTINGS = {"failure_threshold": 3, "cooldown_s": 2.5, "success_threshold": 1}


def test_the_old_key_is_read_as_the_new_one() -> None:
    old = build_config({"breaker": SETTINGS})
    new = build_config({"outlier_detection": SETTINGS})
    assert old == new
    assert old.outlier_detection == OutlierDetectionConfig(3, 2.5, 1)


def test_an_empty_old_section_is_the_defaults() -> None:
    assert build_config({"breaker": None}).outlier_detection == OutlierDetectionConfig()


def test_the_old_key_is_warned_about_once_and_the_new_one_not_at_all() -> None:
    with capture_logs() as logged:
        warn_renamed({"breaker": SETTINGS, "probe": {}})
        warn_renamed({"outlier_detection": SETTINGS})
        warn_renamed(None)
    assert logged == [
        {
            "event": "config_key_deprecated",
            "key": "breaker",
            "use": "outlier_detection",
            "log_level": "warning",
        }
    ]


def test_building_the_config_logs_nothing() -> None:
    """The warning waits for logging to be set up (the CLI calls warn_renamed then)."""
    with capture_logs() as logged:
        build_config({"breaker": SETTINGS})
    assert logged == []


def test_both_keys_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({"breaker": SETTINGS, "outlier_detection": SETTINGS})
    assert str(caught.value) == (
        "breaker: the old name of outlier_detection, which is given too: "
        "give only outlier_detection"
    )


def test_a_problem_in_the_old_section_names_it_and_its_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        build_config({"breaker": {"cooldown": 1}})
    assert str(caught.value) == (
        "breaker: unknown key 'cooldown' (known: failure_threshold, cooldown_s, success_threshold)"
    )


def test_flags_go_into_the_section_read_from_the_old_key() -> None:
    config = build_config(
        {"breaker": SETTINGS}, overrides={"outlier_detection.failure_threshold": 7}
    )
    assert config.outlier_detection == OutlierDetectionConfig(7, 2.5, 1)


def test_the_file_is_not_changed_and_its_renamed_keys_are_listed() -> None:
    data = {"breaker": dict(SETTINGS)}
    build_config(data)
    assert data == {"breaker": SETTINGS}
    assert renamed_keys(data) == ("breaker",)
    assert renamed_keys({"outlier_detection": {}}) == ()
