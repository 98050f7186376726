"""Configuration errors in the file and the flags: YAML syntax errors with their line and
column, a file that is not UTF-8 or not a mapping, flags validated like the file (and the
CLI's exit status 2 with one clear line), and any value anywhere either accepted or one
line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cli.main import main
from gateway.config import SECTIONS, ConfigError, GatewayConfig, build_config, load_file
from tests.support.config_errors import error_of, yaml_file

# -- the file ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("listen: [1, 2\n", "not valid YAML at line 2, column 1: expected ',' or ']'"),
        (
            "listen: 127.0.0.1:1\n  probe: {}\n",
            "not valid YAML at line 2, column 8: mapping values are not allowed here",
        ),
        ("limits:\n\tmax_choices: 2\n", "not valid YAML at line 2, column 1: found character"),
        (
            "listen: 127.0.0.1:1\nlimits: {}\nlisten: 127.0.0.1:2\n",
            "not valid YAML at line 3, column 1: found key 'listen' twice",
        ),
        (
            "limits: {max_choices: 2, max_choices: 3}\n",
            "not valid YAML at line 1, column 26: found key 'max_choices' twice",
        ),
    ],
)
def test_a_yaml_error_names_its_line_and_column(tmp_path: Path, text: str, where: str) -> None:
    path = yaml_file(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_file(path)
    assert str(caught.value).startswith(f"config file {path!r}: {where}")
    assert "\n" not in str(caught.value)


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    text = "x: &base {interval_s: 2, timeout_s: 3}\n"
    data = load_file(yaml_file(tmp_path, text + "probe: {<<: *base, interval_s: 4}\n"))
    assert data["probe"] == {"interval_s": 4, "timeout_s": 3}


def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_bytes(b"listen: \xff\n")
    with pytest.raises(ConfigError, match=r"^config file '.*': not UTF-8 \(byte 8\)$"):
        load_file(str(path))


def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_file(yaml_file(tmp_path, "- grpc://h:1\n"))


def test_empty_sections_are_the_defaults(tmp_path: Path) -> None:
    data = load_file(yaml_file(tmp_path, "probe:\nworkers:\nmodels:\n  m:\n"))
    config = build_config(data)
    assert config.probe == GatewayConfig().probe
    assert config.workers == ()
    assert config.model("m").policy == "round_robin"


# -- flags go through the same validation ------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"listen": 5}, "listen: must be a string, not 5"),
        ({"listen": "nowhere"}, "listen: 'nowhere' is not HOST:PORT"),
        ({"max_attempts": 0}, "max_attempts: must be at least 1, not 0"),
        ({"default_policy": "fastest"}, "default_policy: unknown policy 'fastest'"),
        ({"log_level": "loud"}, "log_level: unknown value 'loud'"),
        ({"processes": 0}, "processes must be auto or 1..64, not 0"),
        ({"probe.interval_s": 0.0}, "probe.interval_s: must be greater than 0, not 0.0"),
        ({"drain.grace_s": -1.0}, "drain.grace_s: must be at least 0, not -1.0"),
        ({"limits.max_choices": "3"}, "limits.max_choices: must be a whole number, not '3'"),
        ({"metrics.listen": "nowhere"}, "metrics.listen: 'nowhere' is not HOST:PORT"),
        ({"tls.cert": "c.pem"}, "tls: cert and key go together"),
        ({"admin.listen": "0.0.0.0:1"}, "admin.listen: '0.0.0.0:1' is not loopback"),
    ],
)
def test_flag_overrides_are_validated_like_the_file(
    overrides: dict[str, Any], message: str
) -> None:
    assert error_of(overrides=overrides).startswith(message)


def test_flags_win_over_the_file_and_a_flag_fixes_the_file() -> None:
    config = build_config(
        {"max_attempts": 0, "probe": {"timeout_s": 2}},
        overrides={"max_attempts": 2, "probe.interval_s": 0.5, "default_policy": None},
    )
    assert config.max_attempts == 2
    assert (config.probe.interval_s, config.probe.timeout_s) == (0.5, 2.0)


def test_a_flag_into_a_section_that_is_not_a_mapping_reports_the_section() -> None:
    assert error_of({"probe": 1}, overrides={"probe.interval_s": 2.0}) == (
        "probe: must be a mapping, not 1"
    )


def yaml_in(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_each_bad_configuration_is_exit_status_2_and_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gateway serve` with each bad configuration: status 2, nothing on stdout, one line
    on stderr naming the bad value (the `gateway` command's entry point, in process; the
    exit status of the process itself: tests/e2e/test_cli.py)."""
    policy = yaml_in(tmp_path, "policy.yaml", "models:\n  m:\n    policy: fastest\n")
    broken = yaml_in(tmp_path, "broken.yaml", "listen: [1, 2\n")
    typo = yaml_in(tmp_path, "typo.yaml", "wrokers: []\n")
    cases: list[tuple[list[str], str]] = [
        (
            ["--worker", "http://127.0.0.1:5000?model=m"],
            "worker 'http://127.0.0.1:5000?model=m': scheme must be grpc:// or grpcs://",
        ),
        (
            ["--worker", "grpc://127.0.0.1:5000?role=boss"],
            "worker 'grpc://127.0.0.1:5000?role=boss': unknown value 'boss' "
            "(expected regular|prefill|decode|encode)",
        ),
        (
            ["--worker", "grpc://127.0.0.1:5000?runtime=tgi"],
            "worker 'grpc://127.0.0.1:5000?runtime=tgi': unknown value 'tgi' "
            "(expected sglang|vllm)",
        ),
        (
            ["--worker", "grpc://127.0.0.1:5000?modle=m"],
            "worker 'grpc://127.0.0.1:5000?modle=m': unknown key 'modle' "
            "(known: model, runtime, role, bootstrap_host, bootstrap_port, embedding_port)",
        ),
        (
            ["--worker", "grpc://127.0.0.1:5000", "--worker", "grpc://127.0.0.1:5000?model=m"],
            "worker 127.0.0.1:5000 is listed twice",
        ),
        (
            ["--config", "/nonexistent/gateway.yaml"],
            "config file '/nonexistent/gateway.yaml': No such file or directory",
        ),
        (
            ["--config", policy],
            "models.m.policy: unknown policy 'fastest' "
            "(expected round_robin|random|power_of_two|least_inflight|consistent_hash|manual"
            "|cache_aware|predicted_latency)",
        ),
        (
            ["--config", broken],
            f"config file '{broken}': not valid YAML at line 2, column 1: "
            "expected ',' or ']', but got '<stream end>'",
        ),
        (["--config", typo], "config: unknown key 'wrokers'"),
    ]
    for args, message in cases:
        assert main(["serve", "--listen", "127.0.0.1:0", *args]) == 2, args
        captured = capsys.readouterr()
        assert captured.out == "", args
        assert captured.err.splitlines() == [f"gateway: config error: {message}"], args


def test_the_cli_turns_a_bad_flag_into_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--listen", "127.0.0.1:0", "--max-attempts", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "gateway: config error: max_attempts: must be at least 1, not 0\n"


# -- whatever the value, a ConfigError of one line ----------------------------------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
FIELDS = [
    *((section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)),
    *((None, f.name) for f in dataclasses.fields(GatewayConfig)),
]


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(FIELDS), value=JUNK)
def test_any_value_anywhere_is_accepted_or_one_line(
    field: tuple[str | None, str], value: Any
) -> None:
    section, name = field
    data = {name: value} if section is None else {section: {name: value}}
    try:
        build_config(data)
    except ConfigError as exc:
        line = str(exc)
        assert line and "\n" not in line
        where = name if section is None else f"{section}"
        assert where in line, line
