"""What a configuration says about its models, read off the validated config: the models
its workers and discovery sources serve (`served_models`), and every model it declares, with
the engine protocols it is declared on (`declared_models`)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gateway.config.gateway import GatewayConfig
from gateway.config.models import named_models
from gateway.core.roles import Runtime


def served_models(config: GatewayConfig) -> frozenset[str]:
    """The models the configured workers and discovery sources name."""
    found = [spec.model for spec in config.workers]
    found += [getattr(source, "model", None) for source in config.discovery]
    return frozenset(m for m in found if m)


def route_targets(config: GatewayConfig) -> tuple[frozenset[str], frozenset[str]]:
    """What the config allows a route to send to (`route_problem`'s `named` and
    `served`): the `models:` that are no alias with the served models, and the served."""
    served = served_models(config)
    return named_models(config.models, served), served


Declared = Mapping[str, frozenset[Runtime] | None]


def declared_models(config: GatewayConfig) -> Declared:
    """Model -> the engine protocols the configuration declares it on (None: any): the
    `models:` entries that are no alias (an alias's targets are among these), and the
    models of the configured workers and discovery sources, on their `runtime` if they
    name one. A declared model is never answered NOT_FOUND for want of a worker: its
    workers may be down or not yet identified."""
    found: dict[str, set[Runtime] | None] = {}
    for name in named_models(config.models, ()):
        found[name] = None
    named = [(spec.model, spec.runtime) for spec in config.workers]
    named += [
        (getattr(source, "model", None), getattr(source, "runtime", None))
        for source in config.discovery
    ]
    for model, runtime in named:
        if not model:
            continue
        if runtime is None or (model in found and found[model] is None):
            found[model] = None
        else:
            runtimes = found.setdefault(model, set())
            assert runtimes is not None
            runtimes.add(runtime)
    return MappingProxyType(
        {m: (None if r is None else frozenset(r)) for m, r in sorted(found.items())}
    )
