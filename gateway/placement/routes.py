"""Model aliases: a name clients send (`chat`) that stands for other models, each call
going to one of them by weight (a canary takes 10 of every 100 calls).

A call with a routing key is sent to the same target for as long as the route and the
set of servable targets stay the same (the key is hashed to a point on the weight line,
the same point in every serving process); one without is sent at random. Targets with no
servable worker are skipped, the others' weights stretched to fill the line. A target
that is itself an alias is resolved again, once (the config allows one level).

`RouteTable` holds the routes: written by its `set` (the config at start, then the admin
API) and `reset` (a reload), read by the resolve stage.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import replace

from gateway.config import Route, route_problem
from gateway.core.verdicts import Verdict

POINTS = float(1 << 64)  # a key's point is its hash's first 8 bytes over this


def point(key: str) -> float:
    """Where on the weight line [0, 1) a routing key falls: the same in every process
    (Python's own hash differs between processes)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / POINTS


def pick(route: Route, usable: Callable[[str], bool], at: float) -> tuple[str, float] | None:
    """The target at point `at` of the line made of the usable targets' weights, and
    where in its own stretch `at` fell (in [0, 1): a nested alias picks by it); None if no
    target of weight above 0 is usable."""
    live = [(model, weight) for model, weight in route if weight > 0 and usable(model)]
    if not live:
        return None
    mark = at * sum(weight for _, weight in live)
    for model, weight in live:
        if mark < weight:
            return model, mark / weight
        mark -= weight
    model, _ = live[-1]  # `at` within a rounding error of 1
    return model, 0.0


class UnknownAlias(LookupError):
    """A route change names a model that is no alias."""


class BadRoute(ValueError):
    """A route change the config's own rules refuse (its one-line reason)."""


Listener = Callable[[], object]


class RouteTable:
    """Alias -> its weighted targets. `named` and `served` are what the config allows a
    route to send to (see `route_problem`): every route the table holds passes it."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        named: frozenset[str] = frozenset(),
        served: frozenset[str] = frozenset(),
    ) -> None:
        self._routes = dict(routes)
        self._named, self._served = named, served
        self._listeners: list[Listener] = []

    def route(self, alias: str) -> Route | None:
        return self._routes.get(alias)

    def routes(self) -> dict[str, Route]:
        """Every alias and its route, by alias."""
        return dict(sorted(self._routes.items()))

    def subscribe(self, listener: Listener) -> None:
        """`listener()` after each change (health follows the routes)."""
        self._listeners.append(listener)

    def set(self, alias: str, route: Route) -> None:
        """The alias's new route, from the next call on. Raises UnknownAlias for a name
        that is no alias, BadRoute for a route the config would refuse."""
        if alias not in self._routes:
            raise UnknownAlias(f"{alias!r} is no alias (aliases: {', '.join(self._routes)})")
        problem = route_problem({**self._routes, alias: route}, self._named, self._served)
        if problem is not None:
            _, message = problem
            raise BadRoute(f"route of {alias!r}: {message}")
        self._routes[alias] = route
        for listener in self._listeners:
            listener()

    def reset(
        self, routes: Mapping[str, Route], named: frozenset[str], served: frozenset[str]
    ) -> None:
        """Every alias and route at once (a reload; `RouteWriter.configure` checked them)."""
        self._routes = dict(routes)
        self._named, self._served = named, served
        for listener in self._listeners:
            listener()

    def leaves(self, alias: str) -> tuple[str, ...]:
        """The models (no aliases) an alias may send to: its weighted targets, a nested
        alias's own in its place."""
        found: list[str] = []
        for model, weight in self._routes.get(alias, ()):
            if weight <= 0:
                continue
            inner = self._routes.get(model)
            found += self.leaves(model) if inner is not None else [model]
        return tuple(dict.fromkeys(found))

    def servable(self, alias: str, servable: Callable[[str], bool]) -> bool:
        """A call for the alias could go somewhere now."""
        return any(servable(model) for model in self.leaves(alias))

    def choose(
        self,
        alias: str,
        servable: Callable[[str], bool],
        key: str | None,
        draw: Callable[[], float] = random.random,
    ) -> str | None:
        """The model (no alias) a call for `alias` goes to: by its routing `key` if it
        has one, else at random (`draw`); None if no target is servable."""
        route = self._routes.get(alias, ())
        at = point(key) if key is not None else draw()
        nested = self._routes

        def usable(model: str) -> bool:
            return self.servable(model, servable) if model in nested else servable(model)

        picked = pick(route, usable, at)
        if picked is None:
            return None
        model, within = picked
        inner = nested.get(model)
        if inner is None:
            return model
        again = pick(inner, servable, within)  # one level: the config allows no more
        return again[0] if again is not None else None

    def heaviest(self, alias: str) -> str:
        """The leaf target of the largest weight (first among equals): whose verdict a call
        gets when no target is servable."""
        route = self._routes[alias]
        model = max(route, key=lambda target: target[1])[0]
        return self.heaviest(model) if model in self._routes else model


def unroutable(alias: str, targets: tuple[str, ...], verdict: Verdict) -> Verdict:
    """The verdict of the alias's heaviest target, told as the alias's: no target could
    take the call."""
    listed = ", ".join(targets)
    return replace(
        verdict,
        message=f"Model '{alias}' routes to {listed}, and none can take a call now: "
        + verdict.message,
        model=alias,
    )
