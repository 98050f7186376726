"""DNS discovery's SRV rounds against a stand-in resolver: targets resolved side by side
within one time bound for the round, a slow target costing the others nothing, a target
that did not answer keeping its addresses of the last round, and more SRV records than
`max_hosts` refused before any target is asked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import dns.exception
import dns.rrset
import pytest
from structlog.testing import capture_logs

from gateway.config import DnsDiscovery
from gateway.discovery import dns as dns_module
from gateway.discovery.dns import DnsError, DnsSource
from gateway.discovery.source import Discovered
from tests.support.waits import until

NAME = "_grpc._tcp.workers.test."
ROUND_S = 0.4  # the round's bound here (ROUND_TIMEOUT_S), and each query's: 0.3 s
SAFETY_S = 10.0


@dataclass
class Resolver:
    """Answers SRV for NAME with `targets` (target -> port) and A for each target in
    `addresses`; a target in `slow` never answers (it waits out the lifetime it is given,
    or forever with `deaf`). Counts what it was asked and how many queries ran at once."""

    targets: dict[str, int]
    addresses: dict[str, list[str]]
    slow: set[str] = field(default_factory=set)
    deaf: bool = False
    asked: list[tuple[str, str, float]] = field(default_factory=list)  # name, kind, lifetime
    running: int = 0
    most: int = 0

    async def resolve(
        self, name: str, kind: str, raise_on_no_answer: bool = True, lifetime: float = 2.0
    ) -> Any:
        self.asked.append((name, kind, lifetime))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.01)  # an answer takes a moment: queries overlap
            if name in self.slow:
                await (asyncio.Event().wait() if self.deaf else asyncio.sleep(lifetime))
                raise dns.exception.Timeout
            if kind == "SRV" and name == NAME:
                texts = [f"0 0 {port} {target}" for target, port in self.targets.items()]
            elif kind == "A" and name in self.addresses:
                texts = self.addresses[name]
            else:
                return SimpleNamespace(rrset=None)  # no records of this kind
            return SimpleNamespace(rrset=dns.rrset.from_text_list(name, 5, "IN", kind, texts))
        finally:
            self.running -= 1


def targets(count: int) -> tuple[dict[str, int], dict[str, list[str]]]:
    names = {f"t{i}.workers.test.": 30000 + i for i in range(count)}
    return names, {name: [f"10.0.0.{i + 1}"] for i, name in enumerate(names)}


@pytest.fixture(autouse=True)
def short_round(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(dns_module, "ROUND_TIMEOUT_S", ROUND_S)
    monkeypatch.setattr(dns_module, "QUERY_TIMEOUT_S", 0.3)
    yield


def source(resolver: Resolver, **settings: Any) -> DnsSource:
    config = DnsDiscovery(source="dns", name=NAME, model="m", **settings)
    made = DnsSource(config)
    made._resolver = resolver  # type: ignore[assignment]
    return made


async def resolve(made: DnsSource) -> list[str]:
    found, _ttl = await asyncio.wait_for(made.resolve(), SAFETY_S)
    return sorted(f"{address}:{port}" for address, port in found)


@pytest.mark.parametrize("deaf", [False, True], ids=["waits-its-lifetime", "never-answers"])
async def test_slow_targets_cost_the_others_nothing_and_the_round_has_one_bound(
    deaf: bool,
) -> None:
    names, addresses = targets(20)
    slow = set(list(names)[15:])
    resolver = Resolver(names, addresses, slow=slow, deaf=deaf)
    made = source(resolver)
    with capture_logs() as logs:
        found = await resolve(made)
    assert found == sorted(f"10.0.0.{i + 1}:{30000 + i}" for i in range(15))
    # Side by side, never more than the bound (two queries a target), each query's time
    # no more than what was left of the round's.
    assert 2 < resolver.most <= 1 + 2 * dns_module.MAX_CONCURRENT_TARGETS
    assert all(lifetime <= ROUND_S for _, _, lifetime in resolver.asked)
    assert {name for name, kind, _ in resolver.asked if kind == "A"} == set(names)
    (line,) = [e for e in logs if e["event"] == "dns_targets_unanswered"]
    assert line["unanswered"] == 5 and line["targets"] == 20 and line["kept"] == 0
    assert line["first"] == sorted(slow)


async def test_a_target_silent_this_round_keeps_its_addresses_one_never_seen_has_none() -> None:
    names, addresses = targets(4)
    resolver = Resolver(names, addresses)
    made = source(resolver)
    first = await resolve(made)
    assert len(first) == 4
    t0, t9 = "t0.workers.test.", "t9.workers.test."
    resolver.targets[t9] = 30009
    resolver.addresses[t9] = ["10.0.0.99"]
    resolver.slow = {t0, t9}
    with capture_logs() as logs:
        assert await resolve(made) == first  # t0 kept, t9 not yet known
        assert await resolve(made) == first  # the same targets silent: not logged again
        resolver.slow = set()
        again = await resolve(made)
    assert again == sorted([*first, "10.0.0.99:30009"])
    events = [e["event"] for e in logs if e["event"].startswith("dns_targets")]
    assert events == ["dns_targets_unanswered", "dns_targets_answered"]
    assert logs[0]["kept"] == 1


async def test_no_target_answering_fails_the_round() -> None:
    names, addresses = targets(3)
    made = source(Resolver(names, addresses, slow=set(names)))
    with pytest.raises(DnsError, match="none of its 3 SRV targets answered"):
        await asyncio.wait_for(made.resolve(), SAFETY_S)


async def test_more_records_than_max_hosts_are_refused_before_any_target_is_asked() -> None:
    names, addresses = targets(5)
    resolver = Resolver(names, addresses)
    made = source(resolver, max_hosts=4, interval_s=1.0)
    reports: list[Sequence[Discovered]] = []
    with capture_logs() as logs:
        task = asyncio.ensure_future(made.run(reports.append))
        try:
            await until(lambda: made.stats.errors > 0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert reports == [] and [kind for _, kind, _ in resolver.asked] == ["SRV"]
    (line,) = [e for e in logs if e["event"] == "discovery_too_many_hosts"]
    assert line["hosts"] == 5 and line["max_hosts"] == 4


async def test_more_addresses_than_max_hosts_are_refused() -> None:
    resolver = Resolver({}, {"workers.test.": ["10.0.0.1", "10.0.0.2", "10.0.0.3"]})
    config = DnsDiscovery(source="dns", name="workers.test.", port=30000, max_hosts=2)
    made = DnsSource(config)
    made._resolver = resolver  # type: ignore[assignment]
    reports: list[Sequence[Discovered]] = []
    task = asyncio.ensure_future(made.run(reports.append))
    try:
        await until(lambda: made.stats.errors > 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert reports == [] and made.stats.failing == "3 hosts, more than max_hosts 2"
