"""`state:`: the store every replica shares (Redis or Valkey, one protocol), for what must
agree across replicas and serving processes: tenants' budgets, model aliases' routes and
session bindings. Without it, each serving process keeps its own."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field
from pydantic.dataclasses import dataclass

from gateway.config.errors import field_error
from gateway.config.fields import SETTINGS, AtLeastOne, Interval, Name, Size

SCHEMES = ("redis", "rediss", "unix")
MAX_PREFIX = 64


def _store_url(url: str) -> str:
    """`redis://HOST:PORT/DB`, `rediss://` (TLS) or `unix:///PATH`: what redis-py takes."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise field_error(f"store URL scheme must be one of {', '.join(SCHEMES)}: {url[:64]!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise field_error(f"store URL names no host: {url[:64]!r}")
    if parts.scheme == "unix" and not parts.path:
        raise field_error(f"store URL names no socket path: {url[:64]!r}")
    return url


def _prefix(prefix: str) -> str:
    if len(prefix) > MAX_PREFIX or not prefix.isprintable() or " " in prefix:
        raise field_error(f"key_prefix: at most {MAX_PREFIX} printable characters, no space")
    return prefix


StoreUrl = Annotated[str, AfterValidator(_store_url)]
Prefix = Annotated[str, AfterValidator(_prefix)]


@dataclass(frozen=True, slots=True, config=SETTINGS)
class StateConfig:
    """Off unless `url` is set. Every store operation is bounded by `timeout_s`; a store
    that fails one is left alone for `retry_s` (calls go on with each process's own
    state meanwhile), then tried again, and what changed while it was away is written
    back. Routes are re-read every `resync_s` besides the change notices."""

    url: StoreUrl | None = Field(
        default=None,
        description="the shared store: `redis://HOST:PORT/DB`, `rediss://` (TLS) or "
        "`unix:///PATH`; null: every serving process keeps its own state",
    )
    key_prefix: Prefix = Field(
        default="gateway:", description="what every key the gateway writes starts with"
    )
    timeout_s: Interval = Field(
        default=0.25, description="bounds each store operation, connecting included"
    )
    retry_s: Interval = Field(
        default=1.0, description="after a failed operation, the store is tried again this late"
    )
    resync_s: Interval = Field(
        default=1.0, description="routes re-read this often, besides the change notices"
    )
    max_value_bytes: Size = Field(
        default=65_536, description="a value read from the store past this is refused as junk"
    )
    max_connections: AtLeastOne = Field(
        default=16, description="connections to the store per serving process"
    )
    password_file: Name | None = Field(
        default=None, description="the store's password, read from this file (else the URL's)"
    )

    @property
    def enabled(self) -> bool:
        return self.url is not None
