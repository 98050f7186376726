"""Per-model settings (`models:`): routing policy and per-worker limits."""

from __future__ import annotations

from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, Flag, Fraction, Whole
from gateway.core.policy_names import PolicyName


@dataclass(frozen=True, slots=True, config=SETTINGS)
class ModelSettings:
    """Per-model routing and limits (limits apply per worker; None means no limit).

    `encode_leg`: multimodal requests need the encode leg even while no encode worker is
    registered (so a missing encoder is LEG_NOT_DEPLOYED, not a silent text-only answer).
    """

    policy: PolicyName = "round_robin"
    encode_leg: Flag = False
    max_inflight: Whole | None = None
    max_waiting: Whole | None = None
    max_token_usage: Fraction | None = None
