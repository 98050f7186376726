"""API keys files and how a key becomes a principal."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, build_config
from gateway.security.bearer import bearer
from gateway.security.keys import ApiKeys


def keys_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_keys_by_name_with_comments_and_blank_lines(tmp_path: Path) -> None:
    keys = ApiKeys.load(
        keys_file(tmp_path, "# team keys\n\nalice: 0123456789abcdef\nbob:fedcba9876543210\n")
    )
    assert keys.name_of("0123456789abcdef") == "alice"
    assert keys.name_of("fedcba9876543210") == "bob"
    assert keys.name_of("0123456789abcdeX") is None
    assert keys.name_of(None) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alice\n", "line 1: expected name:key"),
        ("alice:short\n", "line 1: expected name:key (a key of 16 characters or more)"),
        (":0123456789abcdef\n", "line 1: expected name:key"),
        ("# nothing\n", "has no keys"),
    ],
)
def test_bad_keys_files_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ApiKeys.load(keys_file(tmp_path, text))
    assert message in str(caught.value)


def test_a_missing_keys_file_says_so() -> None:
    with pytest.raises(ConfigError) as caught:
        ApiKeys.load("/nonexistent/keys")
    assert str(caught.value) == "auth.api_keys_file '/nonexistent/keys': No such file or directory"


def test_bearer_reads_the_authorization_metadata() -> None:
    assert bearer((("authorization", "Bearer abc"),)) == "abc"
    assert bearer((("authorization", "bearer  abc "),)) == "abc"
    assert bearer((("authorization", "Basic abc"),)) is None
    assert bearer(()) is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tls": {"cert": "c.pem"}}, "tls: cert and key go together"),
        ({"tls": {"client_ca": "ca.pem"}}, "tls: cert and key go together"),
        ({"upstream_tls": {"key": "k.pem"}}, "upstream_tls: cert and key go together"),
    ],
)
def test_tls_settings_come_in_pairs(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(data)
    assert message in str(caught.value)


def test_grpcs_worker_urls_ask_for_tls() -> None:
    config = build_config(worker_urls=["grpcs://h:1?model=m", "grpc://h:2?model=m"])
    assert [(w.tls, w.url) for w in config.workers] == [
        (True, "grpcs://h:1"),
        (False, "grpc://h:2"),
    ]
