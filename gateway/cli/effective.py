"""The effective configuration, as `gateway check-config` prints it: every key of the
file with its value after the defaults and the flags, secrets masked. It reads back as a
config file that gives the same configuration (but the secrets)."""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import TypeAdapter

from gateway.config import WORKER_URL_KEYS, GatewayConfig, WorkerSpec

MASK = "***"
SECRET_KEYS = frozenset({"token"})  # admin.token: a value shown only as MASK
# A URL's password (state.url: redis://user:PASSWORD@host): the rest of it is shown.
URL_PASSWORD = re.compile(r"^([a-z]+://[^:@/]*:)[^@/]*@")

_GATEWAY: TypeAdapter[GatewayConfig] = TypeAdapter(GatewayConfig)


def _worker(spec: WorkerSpec, fields: dict[str, Any]) -> dict[str, Any]:
    """A `workers:` entry as the file writes one (`fields`: the spec as plain data): its
    url, then every query key."""
    return {"url": spec.url, **{key: fields[key] for key in WORKER_URL_KEYS}}


def masked(value: Any) -> Any:
    """`value` (plain data) with every secret's value, where one is set, as MASK."""
    if isinstance(value, dict):
        return {
            key: MASK if key in SECRET_KEYS and item is not None else masked(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [masked(item) for item in value]
    if isinstance(value, str):
        return URL_PASSWORD.sub(rf"\g<1>{MASK}@", value)
    return value


def effective_config(config: GatewayConfig) -> dict[str, Any]:
    """Every setting as plain data, in the order GatewayConfig declares them."""
    data: dict[str, Any] = _GATEWAY.dump_python(config, mode="json")
    data["workers"] = [_worker(*pair) for pair in zip(config.workers, data["workers"], strict=True)]
    shown: dict[str, Any] = masked(data)
    return shown


def effective_yaml(config: GatewayConfig) -> str:
    return yaml.safe_dump(
        effective_config(config), sort_keys=False, default_flow_style=False, allow_unicode=True
    )


__all__ = ["MASK", "effective_config", "effective_yaml", "masked"]
