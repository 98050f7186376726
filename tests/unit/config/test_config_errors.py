"""Configuration errors in the values: one line each, naming the field by its path in the file
(unknown keys where they are, a string where a list goes, YAML's bare on/off/yes/no where a
string goes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import SECTIONS, build_config, load_file
from tests.support.config_errors import error_of, yaml_file

# -- the field's path, then what is wrong --------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"limits": {"max_inflight_requests": 0}},
            "limits.max_inflight_requests: must be at least 1, not 0",
        ),
        ({"limits": {"max_choices": -3}}, "limits.max_choices: must be at least 1, not -3"),
        ({"probe": {"interval_s": 0}}, "probe.interval_s: must be greater than 0, not 0"),
        ({"kv": {"share_window_s": 0.0}}, "kv.share_window_s: must be greater than 0, not 0.0"),
        ({"drain": {"grace_s": -1}}, "drain.grace_s: must be at least 0, not -1"),
        ({"kv": {"balance_ratio": float("nan")}}, "kv.balance_ratio: must be a finite number"),
        (
            {"outlier_detection": {"cooldown_s": "5 s later"}},
            "outlier_detection.cooldown_s: must be a number, or a duration with its unit "
            "(ms, s, m, h), not '5 s later'",
        ),
        # The old name of outlier_detection: the line names the key the file gave.
        (
            {"breaker": {"cooldown_s": "soon"}},
            "breaker.cooldown_s: must be a number, or a duration with its unit (ms, s, m, h), "
            "not 'soon'",
        ),
        ({"max_attempts": "3"}, "max_attempts: must be a whole number, not '3'"),
        ({"max_attempts": True}, "max_attempts: must be a whole number, not true"),
        ({"kv": {"events": "yes"}}, "kv.events: must be true or false, not 'yes'"),
        ({"admin": {"token": ""}}, "admin.token: must not be empty"),
        ({"log_format": "xml"}, "log_format: unknown value 'xml' (expected console|json)"),
        (
            {"models": {"llama": {"policy": "fastest"}}},
            "models.llama.policy: unknown policy 'fastest' (expected round_robin|random|"
            "power_of_two|least_inflight|consistent_hash|manual|cache_aware|predicted_latency)",
        ),
        (
            {"models": {"qwen2.5:7b": {"max_token_usage": 1.5}}},
            "models['qwen2.5:7b'].max_token_usage: must be at most 1, not 1.5",
        ),
        (
            {"models": {"meta-llama/Llama-3-8B": {"max_inflight": -1}}},
            "models.meta-llama/Llama-3-8B.max_inflight: must be at least 0, not -1",
        ),
        (
            {"models": {"a b": {}}},
            "models['a b']: model name 'a b' has characters other than letters, digits",
        ),
        ({"models": {"m": 3}}, "models.m: must be a mapping, not 3"),
        ({"probe": "fast"}, "probe: must be a mapping, not 'fast'"),
        ({"model_headers": ["x-a", ""]}, "model_headers[1]: must not be empty"),
        ({"workers": ["grpc://h:1?role=boss"]}, "workers[0].role: unknown value 'boss' (expected"),
        (
            {"workers": ["grpc://h:1", {"url": "grpc://h:2", "runtime": "tgi"}]},
            "workers[1].runtime: unknown value 'tgi' (expected sglang|vllm)",
        ),
        (
            {"workers": [{"url": "grpc://h:1", "bootstrap_port": 70000}]},
            "workers[0].bootstrap_port: must be at most 65535, not 70000",
        ),
        (
            {"workers": [{"url": "grpc://h:1", "bootstrap_port": "8998"}]},
            "workers[0].bootstrap_port: must be a whole number, not '8998'",
        ),
        ({"workers": ["http://h:1"]}, "workers[0]: 'http://h:1': scheme must be grpc://"),
        ({"workers": ["grpc://h"]}, "workers[0]: 'grpc://h': needs HOST:PORT"),
        ({"workers": [5]}, "workers[0]: must be a worker URL or a mapping with a url, not 5"),
        ({"workers": [{"url": 5}]}, "workers[0]: url must be a string, not 5"),
        ({"metrics": {"listen": "nowhere"}}, "metrics.listen: 'nowhere' is not HOST:PORT"),
        ({"admin": {"listen": "localhost"}}, "admin.listen: 'localhost' is not HOST:PORT"),
        ({"tls": {"key": "k.pem"}}, "tls: cert and key go together"),
        ({"processes": "many"}, "processes must be auto or 1..64, not 'many'"),
    ],
)
def test_the_line_names_the_field_by_its_path(data: dict[str, Any], message: str) -> None:
    assert error_of(data).startswith(message)


def test_several_problems_are_still_one_line_naming_the_first() -> None:
    message = error_of({"listen": 3, "limits": {"max_choices": 0, "max_connections": 0}})
    assert message == "listen: must be a string, not 3 (and 2 more problems)"
    assert error_of({"listen": 3, "max_attempts": 0}).endswith("(and 1 more problem)")


# -- unknown keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"wrokers": []}, "config: unknown key 'wrokers'"),
        ({1: 2}, "config: unknown key 1"),
        (
            {"probe": {"interval": 1}},
            "probe: unknown key 'interval' (known: interval_s, timeout_s, success_threshold, "
            "failure_threshold)",
        ),
        (
            {"models": {"m": {"polcy": "random"}}},
            "models.m: unknown key 'polcy' (known: policy, encode_leg, max_inflight, "
            "max_waiting, max_token_usage, route, vocab_size)",
        ),
        (
            {"workers": [{"url": "grpc://h:1", "port": 2}]},
            "workers[0]: unknown key 'port' (known: url, model, runtime, role, bootstrap_host, "
            "bootstrap_port, embedding_port)",
        ),
        ({"workers": ["grpc://h:1?modle=m"]}, "workers[0]: 'grpc://h:1?modle=m': unknown key"),
    ],
)
def test_unknown_keys_are_refused_where_they_are(data: dict[Any, Any], message: str) -> None:
    assert error_of(data) == message or error_of(data).startswith(message)


def test_every_section_refuses_unknown_keys() -> None:
    for name in SECTIONS:
        assert error_of({name: {"nope": 1}}).startswith(f"{name}: unknown key 'nope' (known: ")


# -- a string where a list goes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"workers": "grpc://10.0.0.5:30000?model=m"},
            "workers: must be a list, not 'grpc://10.0.0.5:30000?model=m'",
        ),
        ({"model_headers": "x-model"}, "model_headers: must be a list, not 'x-model'"),
        ({"models": ["m"]}, "models: must be a mapping, not ['m']"),
    ],
)
def test_a_string_where_a_list_goes_says_so(data: dict[str, Any], message: str) -> None:
    assert error_of(data) == message


def test_a_string_for_workers_is_not_read_character_by_character(tmp_path: Path) -> None:
    data = load_file(yaml_file(tmp_path, "workers: 'grpc://10.0.0.5:30000'\n"))
    assert error_of(data) == "workers: must be a list, not 'grpc://10.0.0.5:30000'"


# -- YAML's bare on/off/yes/no -------------------------------------------------------------


def test_a_bare_off_for_the_metrics_listen_address_is_told_to_quote_it(tmp_path: Path) -> None:
    data = load_file(yaml_file(tmp_path, "metrics: {listen: off}\n"))
    assert error_of(data) == (
        "metrics.listen: must be a string, not false "
        "(YAML reads a bare off as false: write listen: 'off' to turn metrics off)"
    )
    quoted = load_file(yaml_file(tmp_path, "metrics: {listen: 'off'}\n"))
    assert build_config(quoted).metrics.listen is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "admin: {listen: no}\n",
            "admin.listen: must be a string, not false "
            "(YAML reads a bare off, no or false as false: put the value in quotes)",
        ),
        (
            "listen: on\n",
            "listen: must be a string, not true "
            "(YAML reads a bare on, yes or true as true: put the value in quotes)",
        ),
        (
            "models: {m: {}}\nworkers: [{url: 'grpc://h:1', model: yes}]\n",
            "workers[0].model: must be a string, not true (YAML reads a bare on, yes or true",
        ),
    ],
)
def test_yaml_booleans_where_a_string_goes_get_a_hint(
    tmp_path: Path, text: str, message: str
) -> None:
    assert error_of(load_file(yaml_file(tmp_path, text))).startswith(message)
