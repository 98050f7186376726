"""`Current`: a value a reload replaces while the gateway serves."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Current(Generic[T]):
    """The value in force now. One writer (the reload) replaces it whole; readers read
    `value` at each use and never keep a copy, so every call sees one value or the next,
    never a mixture."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value
