"""Model aliases' pure parts: the weighted pick, renormalisation over servable targets,
determinism per routing key, one level of nesting, and the table's one writer."""

from __future__ import annotations

import random

import pytest

from gateway.core import verdicts
from gateway.placement.routes import (
    BadRoute,
    RouteTable,
    UnknownAlias,
    pick,
    point,
    unroutable,
)

SPLIT = (("v2", 90), ("v3", 10))
NAMED = frozenset({"v2", "v3", "v4"})


def every(model: str) -> bool:
    return True


def table(**routes: tuple[tuple[str, int], ...]) -> RouteTable:
    return RouteTable(routes, NAMED)


def test_ten_thousand_draws_at_90_10_land_within_two_points() -> None:
    draw = random.Random(7).random
    routes = table(chat=SPLIT)
    picks = [routes.choose("chat", every, None, draw) for _ in range(10_000)]
    assert 8_800 <= picks.count("v2") <= 9_200
    assert 800 <= picks.count("v3") <= 1_200


def test_keys_spread_by_weight_too() -> None:
    routes = table(chat=SPLIT)
    picks = [routes.choose("chat", every, f"session-{i}") for i in range(10_000)]
    assert 8_800 <= picks.count("v2") <= 9_200


def test_a_key_always_goes_to_the_same_target() -> None:
    routes = table(chat=(("v2", 50), ("v3", 50)))
    for i in range(100):
        first = routes.choose("chat", every, f"k{i}")
        assert all(routes.choose("chat", every, f"k{i}") == first for _ in range(5))


def test_a_keys_point_is_stable_across_processes() -> None:
    assert point("abc") == point("abc")
    assert 0.0 <= point("abc") < 1.0
    assert point("abc") == pytest.approx(0.8466, abs=1e-4)  # blake2b, not Python's hash


def test_an_unservable_target_is_skipped_and_the_others_fill_the_line() -> None:
    routes = table(chat=(("v2", 60), ("v3", 30), ("v4", 10)))
    draw = random.Random(3).random
    picks = [routes.choose("chat", lambda m: m != "v3", None, draw) for _ in range(10_000)]
    assert picks.count("v3") == 0
    assert 8_300 <= picks.count("v2") <= 8_850  # 60 / 70
    assert routes.choose("chat", lambda m: False, "k") is None


def test_weight_zero_is_never_picked() -> None:
    assert pick((("v2", 0), ("v3", 5)), every, 0.0) == ("v3", 0.0)
    assert pick((("v2", 0),), every, 0.5) is None


def test_pick_says_where_in_the_stretch_the_point_fell() -> None:
    for at, model in ((0.45, "v2"), (0.95, "v3")):
        picked = pick(SPLIT, every, at)
        assert picked is not None and picked[0] == model
        assert picked[1] == pytest.approx(0.5)


def test_a_nested_alias_is_resolved_once_more_by_its_own_weights() -> None:
    routes = table(chat=(("v2", 50), ("canary", 50)), canary=(("v3", 50), ("v4", 50)))
    draw = random.Random(1).random
    picks = [routes.choose("chat", every, None, draw) for _ in range(10_000)]
    assert {"v2", "v3", "v4"} == set(picks)
    assert 2_300 <= picks.count("v3") <= 2_700
    assert routes.leaves("chat") == ("v2", "v3", "v4")
    only_v2 = [routes.choose("chat", lambda m: m == "v2", f"k{i}") for i in range(50)]
    assert set(only_v2) == {"v2"}  # the nested alias has nothing servable: skipped


def test_set_takes_effect_and_tells_listeners() -> None:
    routes = table(chat=SPLIT)
    changes: list[int] = []
    routes.subscribe(lambda: changes.append(1))
    routes.set("chat", (("v2", 0), ("v3", 1)))
    assert routes.choose("chat", every, "any") == "v3"
    assert changes == [1]
    assert routes.routes() == {"chat": (("v2", 0), ("v3", 1))}


@pytest.mark.parametrize(
    ("route", "says"),
    [
        ((("v2", 0), ("v3", 0)), "weight above 0"),
        ((), "at least one target"),
        ((("nope", 1),), "unknown model 'nope'"),
        ((("v2", 1), ("v2", 1)), "listed twice"),
        ((("chat", 1),), "cycle"),
    ],
)
def test_set_refuses_what_the_config_would(route: tuple[tuple[str, int], ...], says: str) -> None:
    routes = table(chat=SPLIT)
    with pytest.raises(BadRoute, match=says):
        routes.set("chat", route)
    assert routes.route("chat") == SPLIT


def test_set_refuses_a_name_that_is_no_alias() -> None:
    with pytest.raises(UnknownAlias):
        table(chat=SPLIT).set("v2", SPLIT)


def test_heaviest_and_the_alias_verdict() -> None:
    routes = table(chat=(("v3", 10), ("canary", 90)), canary=(("v4", 1),))
    assert routes.heaviest("chat") == "v4"
    verdict = verdicts.workers_unavailable("v4", "regular", 2, 1000)
    told = unroutable("chat", routes.leaves("chat"), verdict)
    assert told.reason is verdicts.Reason.WORKERS_UNAVAILABLE
    assert told.model == "chat"
    assert told.message.startswith("Model 'chat' routes to v3, v4, and none can take")
    assert verdict.message in told.message
