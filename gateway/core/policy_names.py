"""The placement policies by name: the built-in ones, and the ones installed plugins add.

Every name maps to where its class lives, as an entry point (`name = "module:Class"`):
the built-ins are the table below, a plugin is an installed distribution that declares
one in the entry point group `grpc_model_gateway.policies`. Both go the same way: the
config validates `default_policy` and each model's `policy` here (`PolicyName`), and
placement (`gateway.placement.policies.registry`) loads the class and builds one policy
per cluster with `Class.build(context)`.

Loading is lazy: a plugin's module is imported only when the config names it, and then
at once, so a broken plugin is a one-line config error at start-up rather than a
traceback when the first worker registers. The built-ins are not imported here: they
ship with the gateway. No imports from the gateway: config is a low layer, and the
placement modules are only named here, as strings.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Annotated

from pydantic import AfterValidator

GROUP = "grpc_model_gateway.policies"
_BUILT_IN_MODULE = "gateway.placement.policies"

BUILT_IN: tuple[EntryPoint, ...] = tuple(
    EntryPoint(name, f"{_BUILT_IN_MODULE}.{target}", GROUP)
    for name, target in (
        ("round_robin", "round_robin:RoundRobin"),
        ("random", "random_pick:Random"),
        ("power_of_two", "power_of_two:PowerOfTwo"),
        ("least_inflight", "least_inflight:LeastInflight"),
        ("consistent_hash", "consistent_hash:ConsistentHash"),
        ("manual", "manual:Manual"),
        ("cache_aware", "cache_aware:CacheAware"),
        ("predicted_latency", "predicted_latency:PredictedLatency"),
    )
)
POLICIES: tuple[str, ...] = tuple(ep.name for ep in BUILT_IN)  # the built-in names


class PolicyError(ValueError):
    """A policy name that is unknown, or whose class cannot be loaded: one line."""


@functools.cache
def table() -> Mapping[str, tuple[EntryPoint, ...]]:
    """Every policy name and what declares it: the built-ins, then the installed plugins
    (by name). Read once per process; more than one declaration under a name is an error
    when the name is used (`entry`)."""
    declared: dict[str, list[EntryPoint]] = {ep.name: [ep] for ep in BUILT_IN}
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        declared.setdefault(ep.name, []).append(ep)
    return {name: tuple(eps) for name, eps in declared.items()}


def policy_names() -> tuple[str, ...]:
    """The names the config accepts (and `--policy` offers): built-ins first."""
    return tuple(table())


def _origin(ep: EntryPoint) -> str:
    """`module:Class`, and the distribution that declares it (a plugin's)."""
    dist = ep.dist
    return ep.value if dist is None else f"{ep.value} from {dist.name}"


def entry(name: str) -> EntryPoint:
    """The one entry point under `name`."""
    declared = table().get(name)
    if declared is None:
        raise PolicyError(f"unknown policy {name!r} (expected {'|'.join(policy_names())})")
    if len(declared) > 1:
        origins = ", ".join(_origin(ep) for ep in declared)
        raise PolicyError(f"policy {name!r} is declared more than once ({origins})")
    return declared[0]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@functools.cache
def load(name: str) -> type:
    """The class registered under `name`, imported on first use. PolicyError if it is
    unknown, does not import, or is not a policy class (one with `build` and `choose`,
    what placement calls: `gateway.placement.policies.Policy` gives both)."""
    ep = entry(name)
    try:
        loaded = ep.load()
    except Exception as exc:  # a plugin's import may raise anything: told in one line
        raise PolicyError(
            f"policy {name!r} ({_origin(ep)}) cannot be loaded: {_one_line(exc)}"
        ) from None
    if not isinstance(loaded, type) or not all(
        callable(getattr(loaded, attr, None)) for attr in ("build", "choose")
    ):
        raise PolicyError(
            f"policy {name!r} ({_origin(ep)}) is not a policy class"
            " (subclass gateway.placement.policies.Policy)"
        )
    return loaded


def check(name: str) -> str:
    """A name the config may use: known, and (a plugin's) its class loads."""
    if entry(name) not in BUILT_IN:
        load(name)
    return name


# A policy name in the config; validation errors read `unknown policy 'x' (expected ...)`.
PolicyName = Annotated[str, AfterValidator(check)]
