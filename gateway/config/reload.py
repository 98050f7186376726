"""What a reload (SIGHUP, `--watch-config`) may change while the gateway serves, and the
config a reload leaves in force: the new file's values for those keys, the running
values for every other (read once at start-up: they need a restart).

One list (`RELOADABLE`) says which keys reload; the configuration reference is generated
from it. A key listed reloads with everything under it (`models`: every model's settings
and routes). A switch (`SWITCHES`) turns a part of the gateway on or off: its values
reload while it stays on, turning it on or off needs a restart (the part is built, or
not, at start-up)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gateway.config.gateway import GatewayConfig
from gateway.config.loading import check_across

RELOADABLE: frozenset[str] = frozenset(
    {
        "models",
        "default_policy",
        "max_attempts",
        "retry_after_ms",
        "tenants",
        "limits.max_choices",
        "limits.max_prompt_tokens",
        "limits.max_completion_tokens",
        "limits.max_inflight_requests",
        "limits.max_inflight_per_principal",
        "limits.request_read_timeout_s",
        "limits.stream_idle_timeout_s",
        "flow.classes",
        "flow.default_class",
        "flow.priority_header",
        "flow.queue",
        "flow.trust_tenant_header",
        "flow.tenant_header",
        "flow.cost_tokens",
        "slo",
        "affinity.header",
        "affinity.ttl_s",
        "affinity.max_sessions",
        "lora.adapters",
        "lora.max_loaded_per_worker",
        "lora.load_on_demand",
        "lora.load_timeout_s",
        "lora.max_listed_per_worker",
        "migration.enabled",
        "migration.max_migrations",
        "migration.max_resent_tokens",
    }
)

# key -> whether its value turns its part on. (`flow`, a section that may be absent, is a
# switch by its shape: absent and present are no two values of one key.)
SWITCHES: dict[str, Callable[[Any], bool]] = {
    "affinity.header": lambda header: header is not None,
    "lora.adapters": bool,
}


def reloads(path: str) -> bool:
    """Whether the key at `path` (as the reference writes it: `models.<model>.policy`,
    `flow.classes[].ttl_s`) takes a reload: it or a section above it is listed."""
    parts = path.replace("[]", "").split(".")
    return any(".".join(parts[:end]) in RELOADABLE for end in range(1, len(parts) + 1))


@dataclasses.dataclass(frozen=True, slots=True)
class Reload:
    """What a reload does: the config in force after it, the keys whose new values it
    applied, and the keys that changed in the file but wait for a restart."""

    config: GatewayConfig
    applied: tuple[str, ...]
    need_restart: tuple[str, ...]


def reload(running: GatewayConfig, read: GatewayConfig) -> Reload:
    """The running config with the file's (`read`) values of every key that reloads;
    ConfigError if that mixture breaks a rule between sections (a route to a model only
    a worker the restart would add serves): then nothing of the file applies."""
    applied: list[str] = []
    restart: list[str] = []
    merged = _merge(running, read, "", applied, restart)
    if applied:  # the merged whole is checked as the file was, across sections too
        check_across(merged)
    return Reload(merged, tuple(applied), tuple(restart))


def _merge(old: Any, new: Any, path: str, applied: list[str], restart: list[str]) -> Any:
    if old == new:
        return old
    if path in RELOADABLE:
        switch = SWITCHES.get(path)
        if switch is not None and switch(old) != switch(new):
            restart.append(path)
            return old
        applied.append(path)
        return new
    if dataclasses.is_dataclass(old) and not isinstance(old, type) and type(old) is type(new):
        changes = {}
        for f in dataclasses.fields(old):
            inner = f"{path}.{f.name}" if path else f.name
            before = getattr(old, f.name)
            after = _merge(before, getattr(new, f.name), inner, applied, restart)
            if after is not before:
                changes[f.name] = after
        return dataclasses.replace(old, **changes) if changes else old
    restart.append(path)
    return old
