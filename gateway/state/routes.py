"""Model aliases' routes, the same on every replica: `set-route` writes the store, and
every serving process follows it.

The rule between the file and the store: the config file names the aliases and gives each
its first route; a route set through the admin API is kept in the store, and for the
aliases it holds, the store wins, at start-up as afterwards. A route in the store for a
name that is no alias here, or one this config's rules refuse, is left out (logged once
per value). Without a store, `set-route` changes the serving process it reaches, until it
restarts.

Each process follows the store two ways: a notice on a channel when a route changes
(applied within milliseconds), and a re-read every `resync_s`, which heals a missed
notice. A route set while the store is away is applied here at once and written to the
store when it answers again, before the store's routes are read back."""

from __future__ import annotations

import json
from collections.abc import Mapping

import structlog

from gateway.config import Route, route_problem
from gateway.placement.routes import BadRoute, RouteTable, UnknownAlias
from gateway.state.store import Store, StoreAway

log = structlog.get_logger("gateway.state")

MAX_TARGETS = 64  # targets in one route read from the store
MAX_ALIAS = 256  # characters of an alias remembered as refused (no model name is longer)


class RouteWriter:
    """The one way a route changes after start-up (the admin API's SetRoute)."""

    def __init__(self, table: RouteTable, store: Store | None = None) -> None:
        self.table = table
        self._store = store
        self._pending: dict[str, Route] = {}  # set while the store was away
        self._refused: dict[str, bytes] = {}  # alias -> the stored value last refused
        self._held: frozenset[str] = frozenset()  # the aliases the store held when last read
        if store is not None:
            self._key = store.key("routes")
            self._channel = store.key("routes", "changed")

    async def set(self, alias: str, route: Route) -> None:
        """The alias's new route here at once, then in the store (every replica follows).
        Raises UnknownAlias or BadRoute as RouteTable.set does, before anything changed."""
        self.table.set(alias, route)
        if self._store is None:
            return
        self._pending[alias] = route
        try:
            await self._write_pending()
        except StoreAway:
            log.warning("route_not_shared_yet", alias=alias, note="written once the store answers")

    def configure(
        self,
        before: Mapping[str, Route],
        after: Mapping[str, Route],
        named: frozenset[str],
        served: frozenset[str],
    ) -> list[str]:
        """A reload of the file's routes (`before` and `after` it): an alias the file
        adds or changes takes the file's route, one it dropped goes; one the file left as
        it was keeps its route here (set through the admin API), and so does one the
        store holds (the store wins). Kept routes that the new file's rules refuse give
        way to the file's. The aliases whose route changed."""
        now = self.table.routes()
        merged = {}
        for alias, route in after.items():
            keep = before.get(alias) == route or alias in self._held
            merged[alias] = now.get(alias, route) if keep else route
        if route_problem(merged, named, served) is not None:
            merged = dict(after)
        self.table.reset(merged, named, served)
        return sorted(a for a in {*now, *merged} if now.get(a) != merged.get(a))

    async def _write_pending(self) -> None:
        store = self._store
        assert store is not None
        for alias, route in list(self._pending.items()):
            value = json.dumps([[model, weight] for model, weight in route])

            async def write(client: object, alias: str = alias, value: str = value) -> None:
                async with client.pipeline(transaction=True) as pipe:  # type: ignore[attr-defined]
                    pipe.hset(self._key, alias, value)
                    pipe.publish(self._channel, alias)
                    await pipe.execute()

            await store.run("route_set", write)
            if self._pending.get(alias) == route:
                del self._pending[alias]

    async def read(self) -> None:
        """The store's routes applied here (what was set here while it was away written
        first); nothing changes if the store is away."""
        store = self._store
        assert store is not None
        try:
            if self._pending:
                await self._write_pending()
            stored = await store.run("routes_read", lambda client: client.hgetall(self._key))
        except StoreAway:
            return
        if not isinstance(stored, Mapping):
            store.invalid("routes_read", f"{self._key} is no hash")
            return
        read = list(stored.items())[: 4 * MAX_TARGETS]
        self._held = frozenset(a.decode(errors="replace") for a, _ in read if isinstance(a, bytes))
        for raw_alias, raw in read:
            self._apply(raw_alias, raw)

    def _apply(self, raw_alias: object, raw: object) -> None:
        store = self._store
        assert store is not None
        if not isinstance(raw_alias, bytes) or not isinstance(raw, bytes):
            return
        alias = raw_alias.decode(errors="replace")
        if self._refused.get(alias[:MAX_ALIAS]) == raw:
            return
        route = parse_route(raw, store.config.max_value_bytes)
        if route is None:
            self._refuse(alias, raw, "a value that is no route")
            return
        if self.table.route(alias) == route:
            return
        try:
            self.table.set(alias, route)
        except (UnknownAlias, BadRoute) as exc:
            self._refuse(alias, raw, str(exc))
            return
        log.info("route_followed", alias=alias, route=[f"{m}={w}" for m, w in route])

    def _refuse(self, alias: str, raw: bytes, why: str) -> None:
        assert self._store is not None
        self._refused[alias[:MAX_ALIAS]] = raw
        if len(self._refused) > 4 * MAX_TARGETS:
            self._refused.pop(next(iter(self._refused)))
        self._store.invalid("routes_read", f"route of {alias[:64]!r}: {why}")

    async def follow(self) -> None:
        """Until cancelled: the store's routes applied on each change notice and every
        `resync_s` (`Store.listen`)."""
        assert self._store is not None
        await self._store.listen(self._channel, self._heard)

    async def _heard(self, _: object) -> None:
        await self.read()  # whichever alias a notice names: the hash is small


def parse_route(raw: bytes, max_bytes: int) -> Route | None:
    """A route as the store holds it (`[["model", weight], ...]`), or None if it is not
    one: too long, no JSON, the wrong shapes, too many targets."""
    if len(raw) > max_bytes:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, list) or not 0 < len(data) <= MAX_TARGETS:
        return None
    route = []
    for target in data:
        if not (isinstance(target, list) and len(target) == 2):
            return None
        model, weight = target
        if not isinstance(model, str) or isinstance(weight, bool):
            return None
        if not isinstance(weight, int) or not 0 <= weight < 1_000_000_000:
            return None
        route.append((model, weight))
    return tuple(route)
