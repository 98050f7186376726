"""`models.<name>.route`: aliases, checked as the config loads, each problem in one line
with its key path."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import ConfigError, build_config, routes_of

WORKERS = [
    "grpc://127.0.0.1:1?model=v2&runtime=sglang",
    "grpc://127.0.0.1:2?model=v3&runtime=sglang",
]


def load(models: dict[str, Any], **extra: Any) -> Any:
    return build_config({"models": models, **extra}, worker_urls=WORKERS)


def split(*targets: tuple[str, int]) -> dict[str, Any]:
    return {"route": [{"model": m, "weight": w} for m, w in targets]}


def test_a_split_loads() -> None:
    config = load({"chat": split(("v2", 90), ("v3", 10))})
    assert routes_of(config.models) == {"chat": (("v2", 90), ("v3", 10))}


def test_targets_may_be_models_keys_discovery_models_or_one_level_of_alias() -> None:
    discovery = [{"source": "dns", "name": "w.example", "port": 1, "model": "v5"}]
    models = {
        "v4": {},
        "canary": split(("v4", 1), ("v5", 1)),
        "chat": split(("v2", 9), ("canary", 1)),
    }
    config = load(models, discovery=discovery)
    assert set(routes_of(config.models)) == {"canary", "chat"}


@pytest.mark.parametrize(
    ("models", "line"),
    [
        (
            {"chat": split(("v2", 1), ("gone", 1))},
            "models.chat.route[1].model: unknown model 'gone' (not a models: key, a "
            "worker's model or a discovery source's model)",
        ),
        (
            {"chat": split(("v2", 0), ("v3", 0))},
            "models.chat.route: needs a weight above 0 (every weight is 0)",
        ),
        ({"chat": {"route": []}}, "models.chat.route: must name at least one target"),
        (
            {"chat": {"route": [{"model": "v2", "weight": -1}]}},
            "models.chat.route[0].weight: must be at least 0, not -1",
        ),
        (
            {"chat": {"route": [{"model": "v2", "weight": 1.5}]}},
            "models.chat.route[0].weight: must be a whole number, not 1.5",
        ),
        (
            {"chat": {"route": [{"model": "v2"}]}},
            "models.chat.route[0].weight: must be given",
        ),
        (
            {"a": split(("b", 1)), "b": split(("a", 1))},
            "models.a.route[0].model: cycle: a -> b -> a",
        ),
        ({"a": split(("a", 1))}, "models.a.route[0].model: cycle: a -> a"),
        (
            {"a": split(("b", 1)), "b": split(("c", 1)), "c": split(("v2", 1))},
            "models.a.route[0].model: too deep: a -> b -> c is an alias of an alias of an "
            "alias (a target may be an alias only one level deep)",
        ),
        (
            {"v2": split(("v3", 1))},
            "models.v2.route: 'v2' is also the model of a worker or discovery source: an "
            "alias needs a name of its own",
        ),
        (
            {"qwen2.5:7b": split(("nope", 1))},
            "models['qwen2.5:7b'].route[0].model: unknown model 'nope' (not a models: key, "
            "a worker's model or a discovery source's model)",
        ),
    ],
)
def test_bad_routes_are_one_line(models: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(models)
    assert str(caught.value) == line
