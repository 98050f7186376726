"""`affinity:`: session affinity, a session's calls kept on the worker its first went to."""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, HeaderName, Interval


@dataclass(frozen=True, slots=True, config=SETTINGS)
class AffinityConfig:
    """Off unless `header` is set. A call whose `header` names a session goes, per leg,
    to the worker the session's last call of that model went to, while that worker is
    available and under its limits; else it is placed by the model's policy and the
    session is bound to where it went. Each serving process keeps at most `max_sessions`
    bindings (the least recently used go first); one unused for `ttl_s` is forgotten."""

    header: HeaderName | None = Field(
        default=None, description="request header naming a call's session; null: affinity off"
    )
    ttl_s: Interval = Field(
        default=600.0, description="a session's binding unused this long is forgotten"
    )
    max_sessions: AtLeastOne = Field(
        default=100_000,
        description="bindings (session, model, leg) kept; the least recently used go",
    )

    @property
    def enabled(self) -> bool:
        return self.header is not None
