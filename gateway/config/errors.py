"""`ConfigError` and the two ways a validator says what is wrong (after the field's
path, or as the whole line), and values shown as the file would have them."""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A configuration problem, told in one line."""


def field_error(message: str) -> PydanticCustomError:
    """A validation error whose message follows the field's path: `PATH: message`."""
    return PydanticCustomError("config", "{message}", {"message": message})


def line_error(message: str) -> PydanticCustomError:
    """A validation error whose message is the whole line (it names its fields itself)."""
    return PydanticCustomError("config_line", "{message}", {"message": message})


def show(value: Any) -> str:
    """A value as the file would have it (YAML's true/false/null), at most 80 characters."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
