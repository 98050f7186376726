"""What the configuration error tests share: the one-line message a configuration is refused
with, and a YAML file written for a test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import ConfigError, build_config


def error_of(data: dict[Any, Any] | None = None, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        build_config(data, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def yaml_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return str(path)
