"""The types of the settings' fields: YAML's own type must match (no "3" for 3), bounds
declared once; and the pydantic settings every section shares."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict

from gateway.config.errors import field_error

MAX_NAME = 256  # characters in a model name


# Model names as engines serve them: `meta-llama/Llama-3-8B`, `qwen2.5:7b`, `org/m@v2`.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


def _model_name_problem(name: str) -> str | None:
    if len(name) > MAX_NAME:
        return f"model name longer than {MAX_NAME} characters"
    if not MODEL_NAME.fullmatch(name):
        return (
            f"model name {name[:64]!r} has characters other than letters, digits and . _ : / @ + -"
        )
    return None


def _model_name(name: str) -> str:
    problem = _model_name_problem(name)
    if problem is not None:
        raise field_error(problem)
    return name


# Sizes and durations as people write them: `256MiB`, `64KiB`, `1GB`; `300ms`, `5s`,
# `2m`, `1h`. A bare number is bytes or seconds as before; a string must carry its unit.
SIZE_UNITS = {
    "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "K": 1024, "M": 1024**2, "G": 1024**3,
}  # fmt: skip
DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
AMOUNT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*")


def _with_unit(value: object, units: Mapping[str, float], kind: str) -> object:
    """`value` as a number of the base unit if it is a string with one of `units`; any
    other value is left to the field's own type (which refuses a bare string)."""
    if not isinstance(value, str):
        return value
    found = AMOUNT.fullmatch(value)
    if found is None or found.group(2) not in units:
        names = ", ".join(units)
        raise field_error(
            f"must be a number, or a {kind} with its unit ({names}), not {value[:32]!r}"
        )
    return float(found.group(1)) * units[found.group(2)]


def _size(value: object) -> object:
    if isinstance(value, float | bool):  # the field's strictness, kept: no 3.0, no true
        raise field_error(f"{value!r} is no whole number of bytes")
    amount = _with_unit(value, SIZE_UNITS, "size")
    if isinstance(amount, float):
        if not amount.is_integer():
            raise field_error(f"{value!r} is no whole number of bytes")
        return int(amount)
    return amount


def _duration(value: object) -> object:
    if isinstance(value, bool):
        raise field_error(f"{value!r} is no duration")
    return _with_unit(value, DURATION_UNITS, "duration")


Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
Name = Annotated[str, Strict(), Field(min_length=1)]  # a path, token, header or host
Whole = Annotated[int, Strict(), Field(ge=0)]
AtLeastOne = Annotated[int, Strict(), Field(ge=1)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
Number = Annotated[float, Strict(), Field(ge=0)]  # a whole number is a number too
Seconds = Annotated[float, BeforeValidator(_duration), Strict(), Field(ge=0)]  # 0: off, or at once
Interval = Annotated[float, BeforeValidator(_duration), Strict(), Field(gt=0)]  # must pass
Size = Annotated[int, BeforeValidator(_size), Strict(), Field(ge=1)]  # bytes
Fraction = Annotated[float, Strict(), Field(ge=0, le=1)]
ModelName = Annotated[str, Strict(), AfterValidator(_model_name)]
HeaderName = Annotated[str, Strict(), Field(min_length=1), AfterValidator(str.lower)]


# Unknown keys are errors; NaN and infinities are not numbers a setting can take.
SETTINGS = ConfigDict(extra="forbid", allow_inf_nan=False)
