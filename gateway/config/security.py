"""`tls:`, `upstream_tls:` and `auth:`: who may call, and TLS both ways."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from gateway.config.errors import field_error, line_error
from gateway.config.fields import SETTINGS, Name, Seconds, Whole


@dataclass(frozen=True, slots=True, config=SETTINGS)
class TlsConfig:
    """TLS on the main port (PEM files). With `client_ca`, clients must present a
    certificate it signed (mTLS); their identity is the caller's principal."""

    cert: Name | None = Field(
        default=None, description="TLS on the main port: certificate chain (PEM)"
    )
    key: Name | None = Field(default=None, description="its private key (PEM)")
    client_ca: Name | None = Field(
        default=None, description="require client certificates this CA signed (mTLS)"
    )

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @model_validator(mode="after")
    def _pairs(self) -> TlsConfig:
        if (self.cert is None) != (self.key is None) or (self.client_ca and not self.cert):
            raise field_error("cert and key go together (and client_ca needs both)")
        return self


@dataclass(frozen=True, slots=True, config=SETTINGS)
class UpstreamTlsConfig:
    """TLS to `grpcs://` workers: `ca` verifies them (default: the system roots); `cert`
    and `key` are the gateway's client certificate where workers require mTLS."""

    ca: Name | None = Field(
        default=None, description="verifies `grpcs://` workers; null: the system roots"
    )
    cert: Name | None = Field(
        default=None, description="the gateway's client certificate, where workers require mTLS"
    )
    key: Name | None = Field(default=None, description="its private key")

    @model_validator(mode="after")
    def _pairs(self) -> UpstreamTlsConfig:
        if (self.cert is None) != (self.key is None):
            raise field_error("cert and key go together")
        return self


@dataclass(frozen=True, slots=True, config=SETTINGS)
class AuthConfig:
    """`api_keys_file`: one `name:key` a line, read again on SIGHUP and when it changes.
    When set, every call on the main port needs `authorization: Bearer <key>`, but
    reflection and the probes' health names ("", liveness, readiness).

    `failure_limit` failed authentications from one peer address within
    `failure_window_s` refuse that address's calls for `block_s`; 0 turns that off."""

    api_keys_file: Name | None = Field(
        default=None,
        description="`name:key` lines; set: every call needs `authorization: Bearer KEY`",
    )
    failure_limit: Whole = Field(
        default=20, description="failed authentications from one address that block it; 0: off"
    )
    failure_window_s: Seconds = Field(default=10.0, description="... counted within this window")
    block_s: Seconds = Field(
        default=30.0, description="a blocked address is refused this long, correct key or not"
    )

    @model_validator(mode="after")
    def _blocking(self) -> AuthConfig:
        if self.failure_limit and (self.failure_window_s <= 0 or self.block_s <= 0):
            raise line_error(
                "auth.failure_window_s and auth.block_s must be positive "
                "(auth.failure_limit: 0 turns blocking off)"
            )
        return self
