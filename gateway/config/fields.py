"""The types of the settings' fields: YAML's own type must match (no "3" for 3), bounds
declared once; and the pydantic settings every section shares."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field, Strict

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


Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
Name = Annotated[str, Strict(), Field(min_length=1)]  # a path, token, header or host
Whole = Annotated[int, Strict(), Field(ge=0)]
AtLeastOne = Annotated[int, Strict(), Field(ge=1)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
Number = Annotated[float, Strict(), Field(ge=0)]  # a whole number is a number too
Seconds = Annotated[float, Strict(), Field(ge=0)]  # 0: off, or at once
Interval = Annotated[float, Strict(), Field(gt=0)]  # a period or timeout that must pass
Fraction = Annotated[float, Strict(), Field(ge=0, le=1)]
ModelName = Annotated[str, Strict(), AfterValidator(_model_name)]
HeaderName = Annotated[str, Strict(), Field(min_length=1), AfterValidator(str.lower)]


# Unknown keys are errors; NaN and infinities are not numbers a setting can take.
SETTINGS = ConfigDict(extra="forbid", allow_inf_nan=False)
