"""Configuration: worker URLs, YAML merging and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, WorkerSpec, build_config, load_file, parse_worker_url
from gateway.core.roles import Role, Runtime


def test_full_worker_url() -> None:
    spec = parse_worker_url(
        "grpc://10.0.0.1:30000?model=m&runtime=vllm&role=prefill&bootstrap_port=8998"
    )
    assert spec == WorkerSpec("10.0.0.1", 30000, "m", Runtime.VLLM, Role.PREFILL, 8998)


def test_bare_worker_url_leaves_model_and_runtime_to_discovery() -> None:
    assert parse_worker_url("grpc://h:1") == WorkerSpec("h", 1)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1", "worker 'http://h:1': scheme must be grpc:// or grpcs://"),
        ("grpc://h", "worker 'grpc://h': needs HOST:PORT"),
        ("grpc://h:1?role=boss", "unknown value 'boss' (expected regular|prefill|decode|encode)"),
        ("grpc://h:1?runtime=trt", "unknown value 'trt' (expected sglang|vllm)"),
        ("grpc://h:1?colour=red", "unknown key 'colour'"),
        ("grpc://h:1?bootstrap_port=x", "bootstrap_port"),
        ("grpc://h:1/path", "unexpected path '/path'"),
    ],
)
def test_bad_worker_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_worker_url(url)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_yaml_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "listen: 127.0.0.1:6000\n"
        "default_policy: random\n"
        "models:\n  m: {policy: power_of_two}\n"
        "workers:\n"
        "  - grpc://127.0.0.1:7000?model=m\n"
        "  - {url: 'grpc://127.0.0.1:7001', model: m, runtime: sglang, role: decode}\n"
    )
    config = build_config(
        load_file(str(path)),
        worker_urls=["grpc://127.0.0.1:7002?model=n"],
        overrides={"listen": "127.0.0.1:0", "default_policy": None},
    )
    assert config.listen == "127.0.0.1:0"
    assert config.policy_for("m") == "power_of_two"
    assert config.policy_for("n") == "random"
    assert [w.port for w in config.workers] == [7000, 7001, 7002]
    assert config.workers[1].role is Role.DECODE
    assert config.workers[1].runtime is Runtime.SGLANG


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"colour": 1}, "config: unknown key 'colour'"),
        ({"default_policy": "fastest"}, "unknown policy 'fastest'"),
        ({"models": {"m": {"policy": "x"}}}, "models.m.policy: unknown policy 'x'"),
        ({"listen": "nowhere"}, "listen: 'nowhere' is not HOST:PORT"),
        ({"max_attempts": 0}, "max_attempts: must be at least 1"),
        ({"limits": {"max_choices": 0}}, "limits.max_choices: must be at least 1"),
        ({"limits": {"max_inflight_requests": 0}}, "limits.max_inflight_requests: must be at"),
        ({"limits": {"max_streams": 1}}, "limits: unknown key 'max_streams'"),
        ({"max_attempts": 2.9}, "max_attempts: must be a whole number, not 2.9"),
        ({"listen": 5}, "listen: must be a string, not 5"),
        ({"model_headers": "x-model"}, "model_headers: must be a list, not 'x-model'"),
        (
            {"log_level": "verbose"},
            "log_level: unknown value 'verbose' (expected debug|info|warning|error",
        ),
        (
            {"probe": {"interval_s": "fast"}},
            "probe.interval_s: must be a number, or a duration with its unit (ms, s, m, h), "
            "not 'fast'",
        ),
        (
            {"admin": {"listen": "0.0.0.0:50052"}},
            "admin.listen: '0.0.0.0:50052' is not loopback: give the admin API a token",
        ),
        ({"workers": ["grpc://h:1?model=" + "x" * 257]}, "model name longer than 256 characters"),
        ({"workers": ["grpc://h:1?model=a%20b"]}, "has characters other than letters, digits"),
        ({"workers": ["grpc://h:1?model=m&bootstrap_host=" + "h" * 3000]}, "longer than 2048"),
        ({"workers": ["grpc://h:1", "grpc://h:1"]}, "worker h:1 is listed twice"),
        ({"workers": [{"model": "m"}]}, "needs a url"),
    ],
)
def test_bad_config_values(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(data)
    assert message in str(caught.value)


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_file(str(tmp_path / "absent.yaml"))
    assert str(caught.value).startswith("config file ")
    assert "No such file or directory" in str(caught.value)


def test_a_non_loopback_admin_port_with_a_token_is_fine() -> None:
    config = build_config({"admin": {"listen": "0.0.0.0:50052", "token": "t"}})
    assert config.admin.listen == "0.0.0.0:50052"
    assert build_config({"admin": {"listen": "[::1]:50052"}}).admin.token is None


def test_model_names_as_engines_serve_them_are_accepted() -> None:
    for name in ("meta-llama/Llama-3-8B-Instruct", "qwen2.5:7b", "org/m@v2", "a_b-c.d"):
        assert parse_worker_url(f"grpc://h:1?model={name}").model == name
