"""`gateway envoy-config`: the Envoy bootstrap for picker mode. deploy/envoy/envoy.yaml is
its output with the defaults, and Envoy itself (`--mode validate`: the whole bootstrap
parsed and checked, nothing bound or started) accepts it and the test setup's variant."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.picker.envoy import envoy_config
from gateway_sim.envoy import envoy_binary

ROOT = Path(__file__).resolve().parents[2]
DEPLOYED = ROOT / "deploy" / "envoy" / "envoy.yaml"
RUN_S = 30.0  # one Python start-up, or one Envoy parsing a bootstrap


def envoy_config_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "envoy-config", *args],
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )


def validate(binary: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, "--mode", "validate", "-c", str(path), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )


def made_by(text: str) -> list[str]:
    """The command in the output's opening comment (after `made by`)."""
    head = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        head.append(line.lstrip("# ").removesuffix("\\"))
    words = shlex.split(" ".join(head))
    start = words.index("envoy-config")
    end = next(i for i, w in enumerate(words) if w.startswith("Run"))
    return words[start + 1 : end]


def test_the_deployed_file_is_the_commands_output_with_the_defaults() -> None:
    result = envoy_config_command()
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert DEPLOYED.read_text() == result.stdout, (
        "deploy/envoy/envoy.yaml is stale: .venv/bin/gateway envoy-config > deploy/envoy/envoy.yaml"
    )
    deployed = yaml.safe_load(result.stdout)
    assert deployed == envoy_config("0.0.0.0:8080", "127.0.0.1:9002")
    # The picker's filter, the Lua that keeps the answers' last messages for it, the router.
    manager = deployed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = [f["name"] for f in manager["typed_config"]["http_filters"]]
    assert filters == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.lua",
        "envoy.filters.http.router",
    ]
    assert "inline_string: |\n" in result.stdout  # the Lua source as a readable block


def test_flags_reach_the_bootstrap_and_its_comment_makes_it_again() -> None:
    flags = (
        "--listen", "127.0.0.1:0", "--picker", "[::1]:9002", "--admin", "off",
        "--header", "X-Picked", "--message-timeout-s", "300", "--no-token-counts",
    )  # fmt: skip
    result = envoy_config_command(*flags)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == envoy_config(
        "127.0.0.1:0",
        "[::1]:9002",
        admin=None,
        header="x-picked",
        message_timeout_s=300,
        token_counts=False,
    )
    assert "envoy.filters.http.lua" not in result.stdout
    again = envoy_config_command(*made_by(result.stdout))
    assert again.stdout == result.stdout


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--listen", "8080"), "argument --listen: '8080' is not HOST:PORT"),
        (("--picker", "host:port"), "argument --picker: 'host:port' is not HOST:PORT"),
        (("--admin", "none"), "argument --admin: 'none' is not HOST:PORT"),
        (("--header", "x y"), "argument --header: 'x y' is not a header name"),
        (("--message-timeout-s", "0"), "argument --message-timeout-s: '0' is not seconds"),
        (("--message-timeout-s", "nan"), "argument --message-timeout-s: 'nan' is not seconds"),
    ],
)
def test_a_bad_flag_is_a_usage_error(flags: tuple[str, str], said: str) -> None:
    result = envoy_config_command(*flags)
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"gateway envoy-config: error: {said}" in result.stderr


def test_help_says_what_the_timeout_must_cover() -> None:
    result = envoy_config_command("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: gateway envoy-config ")
    assert "flow.classes[].ttl_s" in result.stdout
    assert "\nexit status:\n" in result.stdout


@pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary")
def test_envoy_accepts_the_deployed_file_and_the_tests_variant(tmp_path: Path) -> None:
    binary = envoy_binary()
    assert binary is not None
    variant = envoy_config_command(
        "--listen", "127.0.0.1:0", "--picker", "127.0.0.1:0", "--admin", "127.0.0.1:0"
    )
    assert variant.returncode == 0, variant.stderr
    (tmp_path / "variant.yaml").write_text(variant.stdout)
    for path in (DEPLOYED, tmp_path / "variant.yaml"):
        result = validate(binary, path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"configuration '{path}' OK" in result.stdout
    # The check can fail: a value Envoy does not know is refused, naming it.
    broken = tmp_path / "broken.yaml"
    broken.write_text(variant.stdout.replace("response_body_mode: NONE", "response_body_mode: NO"))
    result = validate(binary, broken)
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert f"error initializing configuration '{broken}'" in said
    assert "processing_mode.response_body_mode" in said
