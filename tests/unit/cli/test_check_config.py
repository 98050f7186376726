"""`gateway check-config` in process: the effective configuration it prints (every key,
defaults and flags applied, secrets masked, readable back as a config file), and for
each kind of bad configuration the very line and status `gateway serve` gives. (The
process's own exit status, the files serve reads at start-up and the ports it does not
bind: tests/e2e/test_check_config.py.)"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from gateway.cli.effective import MASK, effective_config, masked
from gateway.cli.main import build_parser, config_from_args, main
from gateway.config import LOG_LEVELS, SECTIONS, GatewayConfig, build_config
from gateway.observability import logs

FILE = """\
listen: 127.0.0.1:7000
admin:
  token: hunter2
breaker:
  cooldown_s: 3
workers:
  - grpc://127.0.0.1:5000?model=m&runtime=sglang
  - url: grpc://127.0.0.1:5001
    role: prefill
    bootstrap_port: 9000
models:
  m:
    max_inflight: 4
"""


@pytest.fixture(autouse=True)
def _logs_as_they_were(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """check-config sets the logs up (for the warnings serve would log): undone after,
    and with no logger cached meanwhile (a cached one would keep writing to this test's
    captured stderr, and ignore every later test's set-up)."""
    configure = logs.configure

    def uncached(*args: Any, **kwargs: Any) -> None:
        configure(*args, **kwargs)
        structlog.configure(cache_logger_on_first_use=False)

    monkeypatch.setattr(logs, "configure", uncached)
    yield
    structlog.reset_defaults()
    logs.prefer("console")


def config_file(tmp_path: Path, text: str, name: str = "gateway.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["check-config", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_valid_file_prints_every_key_with_defaults_flags_and_masked_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config_file(tmp_path, FILE)
    code, out, err = check(capsys, path, "--max-attempts", "5", "--log-level", "warning")
    assert code == 0, err
    shown = yaml.safe_load(out)
    fields = [f.name for f in dataclasses.fields(GatewayConfig)]
    assert list(shown) == fields  # every top-level key, in the declared order
    for section, cls in SECTIONS.items():  # and every key of every section
        assert list(shown[section]) == [f.name for f in dataclasses.fields(cls)], section
    assert shown["listen"] == "127.0.0.1:7000"  # the file
    assert (shown["max_attempts"], shown["log_level"]) == (5, "warning")  # the flags
    assert shown["probe"]["interval_s"] == 1.0  # a default
    assert shown["outlier_detection"]["cooldown_s"] == 3.0  # the old key, by its new name
    assert "breaker" not in shown
    assert shown["admin"] == {"listen": "127.0.0.1:50052", "token": MASK}
    assert "hunter2" not in out
    assert shown["models"]["m"]["policy"] == "round_robin"  # inherited from default_policy
    assert shown["workers"] == [
        {
            "url": "grpc://127.0.0.1:5000",
            "model": "m",
            "runtime": "sglang",
            "role": None,
            "bootstrap_host": None,
            "bootstrap_port": None,
            "embedding_port": None,
        },
        {
            "url": "grpc://127.0.0.1:5001",
            "model": None,
            "runtime": None,
            "role": "prefill",
            "bootstrap_host": None,
            "bootstrap_port": 9000,
            "embedding_port": None,
        },
    ]
    assert "config_key_deprecated" in err  # the warning serve would log, and nothing else
    assert len(err.splitlines()) == 1


def test_what_it_prints_reads_back_as_the_same_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flow = "flow: {}\ntenants:\n  t: {weight: 2}\ndiscovery:\n  - {source: dns, name: w, port: 1}\n"
    code, first, err = check(capsys, config_file(tmp_path, FILE + flow))
    assert code == 0, err
    code, again, err = check(capsys, config_file(tmp_path, first, "effective.yaml"))
    assert code == 0, err
    assert again == first


def test_without_a_file_the_defaults_and_flags_are_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = check(capsys, "--listen", "127.0.0.1:7001", "--log-level", "critical")
    assert (code, err) == (0, "")
    flags = {"listen": "127.0.0.1:7001", "log_level": "critical"}
    expected = effective_config(build_config(overrides=flags))
    assert yaml.safe_load(out) == expected
    assert expected["admin"]["token"] is None  # no secret set: nothing to mask


def test_the_file_is_given_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_file(tmp_path, FILE)
    with pytest.raises(SystemExit) as exited:
        main(["check-config", path, "--config", path])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_masked_hides_every_token_that_is_set() -> None:
    data: dict[str, Any] = {"admin": {"token": "t", "listen": "x"}, "a": [{"token": None}]}
    assert masked(data) == {"admin": {"token": MASK, "listen": "x"}, "a": [{"token": None}]}


def test_log_level_takes_every_level_the_config_takes() -> None:
    assert "critical" in LOG_LEVELS
    for level in LOG_LEVELS:
        args = build_parser().parse_args(["serve", "--log-level", level])
        assert config_from_args(args).log_level == level


BAD_FILES = {
    "yaml": "listen: [1, 2\n",
    "unknown_key": "wrokers: []\n",
    "bad_value": "limits:\n  max_choices: 0\n",
    "bad_policy": "models:\n  m:\n    policy: fastest\n",
    "tenant_class": "tenants:\n  t:\n    max_class: gold\n",
    "open_admin": "admin:\n  listen: 0.0.0.0:50052\n",
    "both_names": "breaker: {}\noutlier_detection: {}\n",
}
BAD_FLAGS: dict[str, list[str]] = {
    "worker_url": ["--worker", "http://127.0.0.1:5000?model=m"],
    "worker_twice": ["--worker", "grpc://127.0.0.1:5000", "--worker", "grpc://127.0.0.1:5000"],
    "flag_value": ["--max-attempts", "0"],
    "listen": ["--listen", "nowhere"],
    "missing_file": ["--config", "/nonexistent/gateway.yaml"],
    "token_file": ["--admin-token-file", "/nonexistent/token"],
    "json_line": ["--log-format", "json", "--max-attempts", "0"],
}


@pytest.mark.parametrize("kind", [*BAD_FILES, *BAD_FLAGS])
def test_each_kind_of_error_is_exit_2_and_the_line_serve_prints(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if kind in BAD_FILES:
        args = ["--config", config_file(tmp_path, BAD_FILES[kind])]
    else:
        args = BAD_FLAGS[kind]
    code, out, err = check(capsys, *args)
    assert (code, out) == (2, ""), err
    assert len(err.splitlines()) == 1
    assert "config error: " in err
    # Serve only once check-config refused it: it fails before it listens, in process.
    assert main(["serve", *args]) == 2
    served = capsys.readouterr()
    assert served.out == ""
    assert without_time(served.err) == without_time(err)


def without_time(line: str) -> str:
    """A JSON line's timestamp is its moment's; the rest is the same line."""
    return re.sub(r'"timestamp": "[^"]*"', '"timestamp": ...', line)
