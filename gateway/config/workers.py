"""Workers as configured: a URL, or a mapping with a url and the URL's query keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from pydantic import BeforeValidator, Field
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from gateway.config.errors import ConfigError, field_error, show
from gateway.config.fields import SETTINGS, Flag, ModelName, Name, Port
from gateway.core.roles import Role, Runtime

WORKER_URL_KEYS = (
    "model",
    "runtime",
    "role",
    "bootstrap_host",
    "bootstrap_port",
    "embedding_port",
)


MAX_URL = 2048  # characters in a worker URL


@dataclass(frozen=True, slots=True, config=SETTINGS)
class WorkerSpec:
    """One worker as configured; unknown `model`/`runtime` are discovered from the worker."""

    host: Name
    port: Port
    model: ModelName | None = Field(
        default=None,
        description="the model it serves; absent: asked from the worker (`GetModelInfo`)",
    )
    runtime: Runtime | None = Field(
        default=None,
        description="its engine protocol; absent: detected from the services it serves",
    )
    # None: asked from the worker (GetServerInfo), else regular
    role: Role | None = Field(
        default=None,
        description="absent: regular, or asked from the worker when model or runtime are",
    )
    bootstrap_port: Port | None = Field(
        default=None, description="SGLang prefill: its bootstrap port (else asked; else 8998)"
    )
    bootstrap_host: Name | None = Field(
        default=None,
        description=(
            "SGLang prefill: the host decode workers fetch KV from (default: the URL's host)"
        ),
    )
    embedding_port: Port | None = Field(
        default=None, description="EPD prefill: the port encoders push embeddings to"
    )
    tls: Flag = False  # grpcs://: TLS to the worker (see UpstreamTlsConfig)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'grpcs' if self.tls else 'grpc'}://{self.address}"

    def full_url(self) -> str:
        """The URL `parse_worker_url` reads back into this spec."""
        query = {key: getattr(self, key) for key in WORKER_URL_KEYS}
        given = {k: str(v) for k, v in query.items() if v is not None}
        return self.url + (f"?{urlencode(given)}" if given else "")


# -- workers: a URL, or a mapping with a url and the URL's query keys ----------------------


class _UrlProblem(ValueError):
    """What is wrong with a worker URL itself (not with one of its values)."""


def _port(key: str, value: str) -> int:
    if not value.isdigit() or not 0 < int(value) <= 65535:
        raise _UrlProblem(f"{key} {value!r} is not a port number")
    return int(value)


def _url_fields(url: str) -> dict[str, Any]:
    """A worker URL's fields, left for WorkerSpec to validate (ports made numbers)."""
    parts = urlsplit(url)
    if parts.scheme not in ("grpc", "grpcs"):
        raise _UrlProblem("scheme must be grpc:// or grpcs://")
    if parts.path not in ("", "/"):
        raise _UrlProblem(f"unexpected path {parts.path!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise _UrlProblem(str(exc)) from None
    if not host or port is None:
        raise _UrlProblem("needs HOST:PORT")
    if not 0 < port <= 65535:
        raise _UrlProblem(f"port {port} is not a port number")
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - set(WORKER_URL_KEYS))
    if unknown:
        raise _UrlProblem(f"unknown key {unknown[0]!r} (known: {', '.join(WORKER_URL_KEYS)})")
    fields: dict[str, Any] = {"host": host, "port": port, "tls": parts.scheme == "grpcs"}
    for key, values in query.items():
        value = values[-1]
        if value:  # `model=` is no model
            fields[key] = _port(key, value) if key.endswith("_port") else value
    return fields


def _checked_url_fields(url: str) -> dict[str, Any]:
    if len(url) > MAX_URL:
        raise field_error(f"URL longer than {MAX_URL} characters")
    try:
        return _url_fields(url)
    except _UrlProblem as exc:
        raise PydanticCustomError(
            "worker_url", "{url}: {problem}", {"url": repr(url), "problem": str(exc)}
        ) from None


def _worker_entry(entry: Any) -> Any:
    """One `workers:` entry as WorkerSpec's fields: a URL string, or a mapping whose
    `url` the other keys (the URL's query keys) add to or override."""
    if isinstance(entry, WorkerSpec):
        return entry
    if isinstance(entry, str):
        return _checked_url_fields(entry)
    if not isinstance(entry, Mapping):
        raise field_error(f"must be a worker URL or a mapping with a url, not {show(entry)}")
    if "url" not in entry:
        raise field_error(f"{show(dict(entry))} needs a url")
    known = ("url", *WORKER_URL_KEYS)
    unknown = sorted(str(k) for k in entry if k not in known)
    if unknown:
        raise field_error(f"unknown key {unknown[0]!r} (known: {', '.join(known)})")
    url = entry["url"]
    if not isinstance(url, str):
        raise field_error(f"url must be a string, not {show(url)}")
    fields = _checked_url_fields(url)
    fields.update({k: v for k, v in entry.items() if k != "url" and v is not None})
    return fields


# A `workers:` entry: validated into a WorkerSpec whatever its form.
WorkerEntry = Annotated[WorkerSpec, BeforeValidator(_worker_entry)]


def check_workers(workers: Sequence[WorkerSpec]) -> None:
    """No encode worker without a model, no address listed twice."""
    seen: set[str] = set()
    for spec in workers:
        if spec.role is Role.ENCODE and not spec.model:
            raise ConfigError(f"worker {spec.address}: an encode worker needs model=")
        if spec.address in seen:
            raise ConfigError(f"worker {spec.address} is listed twice")
        seen.add(spec.address)
