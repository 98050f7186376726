"""`--help` tells the whole story: `gateway serve --help` lists every flag, every worker
URL query key and every environment variable the gateway reads (found in its source,
so a new one cannot go unlisted); `gateway check-config --help` and `gateway workers
--help` give their exit statuses."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from gateway.admin.client import exit_status_help
from gateway.cli.main import build_parser, main
from gateway.config import WORKER_URL_KEYS

ROOT = Path(__file__).resolve().parents[3]
ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[name]
    return found


def environment_variables() -> set[str]:
    """The upper-case string constants of every gateway module that reads the
    environment, but the module's own names (`__all__` entries)."""
    found: set[str] = set()
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        text = path.read_text()
        if "environ" not in text and "getenv" not in text:
            continue
        tree = ast.parse(text)
        defined = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)
        }
        found |= {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and ENV_NAME.fullmatch(node.value)
            and node.value not in defined
        }
    return found


def test_the_scan_finds_the_variables_it_is_meant_to() -> None:
    assert {"GATEWAY_ADMIN_TOKEN", "GATEWAY_LOOP", "OTEL_SERVICE_NAME", "GRPC_TRACE"} <= (
        environment_variables()
    )


def test_serve_help_lists_every_flag_url_key_and_environment_variable() -> None:
    serve = subcommand("serve")
    text = serve.format_help()
    for action in serve._actions:
        for flag in action.option_strings:
            assert flag in text
    for key in WORKER_URL_KEYS:
        assert f"    {key}=" in text, key
    environment = text.partition("\nenvironment:\n")[2]
    for name in sorted(environment_variables()):
        assert name in environment, name
    assert "--log-level {debug,info,warning,error,critical}" in text


def test_check_config_takes_every_flag_of_serve_and_says_its_exit_statuses() -> None:
    check, serve = subcommand("check-config"), subcommand("serve")
    flags = [a.option_strings for a in serve._actions]
    assert [a.option_strings for a in check._actions if a.option_strings] == flags
    text = check.format_help()
    assert "exit status:\n  0  the configuration is valid" in text
    assert "(`gateway: config error: ...`)" in text


@pytest.mark.parametrize("argv", [["workers", "--help"], ["workers", "add", "--help"]])
def test_workers_help_ends_with_the_exit_status_table(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    assert capsys.readouterr().out.endswith("\n" + exit_status_help())
