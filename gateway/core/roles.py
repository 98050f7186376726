"""The vocabulary every layer shares: which engine a worker runs and which leg it serves."""

from __future__ import annotations

from enum import StrEnum


class Runtime(StrEnum):
    """The engine protocol a worker speaks."""

    SGLANG = "sglang"
    VLLM = "vllm"


class Role(StrEnum):
    """What part of a request a worker does; `regular` does all of it."""

    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


# The roles whose workers serve the engine's protocol (an encoder serves only its own).
ENGINE_ROLES = (Role.REGULAR, Role.PREFILL, Role.DECODE)
