"""The two names sglang/utils.py imports; calling either is a bug here."""

from __future__ import annotations

from typing import Any


class HTML:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("IPython stand-in: HTML is not available in the test tier")


def display(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("IPython stand-in: display is not available in the test tier")
