"""DNS discovery (dnspython): a name's A/AAAA records with a configured port, or its SRV
records (each a host and its port), resolved again every `interval_s`, or sooner when
the records' TTL is shorter, never faster than once a second.

A failed resolution (no answer in time, SERVFAIL, NXDOMAIN) and an answer with no
address keep the last known hosts: a DNS outage never empties a cluster. It is logged
once per outage and counted.

A round (the SRV query, then every target's A and AAAA queries) has one time bound,
ROUND_TIMEOUT_S, whatever the number of targets: the targets are resolved side by side
(MAX_CONCURRENT_TARGETS at a time), and one that does not answer in time takes nothing
from the others. Such a target keeps the addresses it had last round (one never resolved
has none yet); which targets did not answer is logged when that changes. Only when no
target answers does the round fail. More SRV records than `max_hosts` are refused
before any target is resolved.
"""

from __future__ import annotations

import asyncio

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver
import structlog

from gateway.config import DnsDiscovery, WorkerSpec, parse_address
from gateway.core.tasks import TaskScope
from gateway.discovery.source import Discovered, Report, SourceStats, publish

log = structlog.get_logger("gateway.discovery")

MIN_INTERVAL_S = 1.0
QUERY_TIMEOUT_S = 2.0  # one query (a kind of record of one name)
ROUND_TIMEOUT_S = 3.0  # one round, every query of it together
MAX_CONCURRENT_TARGETS = 16  # SRV targets resolved at once (two queries each)
LOGGED_TARGETS = 10  # unanswered targets named in a log line (the rest counted)

AddressPort = tuple[str, int]


class DnsError(Exception):
    """This resolution said nothing usable: the last hosts stay."""


class TooManyRecords(Exception):
    """More SRV records than the source may report hosts: refused, the last hosts stay."""

    def __init__(self, records: int) -> None:
        super().__init__(f"{records} SRV records")
        self.records = records


class DnsSource:
    def __init__(self, config: DnsDiscovery) -> None:
        self.config = config
        self.stats = SourceStats(config.label)
        resolver = dns.asyncresolver.Resolver(configure=config.nameserver is None)
        if config.nameserver is not None:
            host, port = parse_address(config.nameserver, "nameserver")
            resolver.nameservers = [host]
            resolver.port = port
        resolver.lifetime = QUERY_TIMEOUT_S
        resolver.cache = None
        self._resolver = resolver
        # SRV target -> its addresses as last answered (this round's targets only).
        self._known: dict[str, list[str]] = {}
        self._unanswered: list[str] = []  # the targets that did not answer, as logged

    async def run(self, report: Report) -> None:
        interval = self.config.interval_s
        while True:
            wait = interval
            try:
                targets, ttl = await self.resolve()
            except DnsError as exc:
                self.stats.failed(str(exc))
            except TooManyRecords as exc:
                self.stats.too_many(exc.records, self.config.max_hosts)
            else:
                hosts = [self._host(address, port) for address, port in targets]
                if publish(report, self.stats, hosts, self.config.max_hosts):
                    wait = max(MIN_INTERVAL_S, min(interval, ttl))
            await asyncio.sleep(wait)

    def _host(self, address: str, port: int) -> Discovered:
        c = self.config
        spec = WorkerSpec(
            host=address, port=port, model=c.model, runtime=c.runtime, role=c.role, tls=c.tls
        )
        return Discovered(spec, c.label)

    async def resolve(self) -> tuple[list[AddressPort], float]:
        """(address, port) pairs, sorted, and the shortest TTL among the records read;
        within ROUND_TIMEOUT_S."""
        deadline = asyncio.get_running_loop().time() + ROUND_TIMEOUT_S
        name, port = self.config.name, self.config.port
        if port is not None:
            addresses, ttl = await self._addresses(name, deadline)
            targets = [(a, port) for a in addresses]
        else:
            targets, ttl = await self._srv(name, deadline)
        if not targets:
            raise DnsError(f"{name} resolves to no address")
        return sorted(set(targets)), ttl

    async def _query(self, name: str, kind: str, deadline: float) -> tuple[list[str], float]:
        """The records' texts and TTL; no records of this kind is an empty answer."""
        lifetime = min(QUERY_TIMEOUT_S, deadline - asyncio.get_running_loop().time())
        if lifetime <= 0:
            raise DnsError(f"{name}: no time left in this round")
        try:
            answer = await self._resolver.resolve(
                name, kind, raise_on_no_answer=False, lifetime=lifetime
            )
        except dns.resolver.NXDOMAIN:
            raise DnsError(f"{name}: no such name (NXDOMAIN)") from None
        except dns.exception.Timeout:
            raise DnsError(f"{name}: no answer within {lifetime:.3g} s") from None
        except dns.exception.DNSException as exc:
            raise DnsError(f"{name}: {exc}") from None
        rrset = answer.rrset
        if rrset is None:
            return [], float("inf")
        return [record.to_text() for record in rrset], float(rrset.ttl)

    async def _addresses(self, name: str, deadline: float) -> tuple[list[str], float]:
        """A and AAAA records: one kind failing (a server refusing AAAA for a name it
        only has A records for) is no failure while the other answers."""
        found: list[str] = []
        ttl = float("inf")
        errors: list[DnsError] = []
        answers = await asyncio.gather(
            self._query(name, "A", deadline),
            self._query(name, "AAAA", deadline),
            return_exceptions=True,
        )
        for answer in answers:
            if isinstance(answer, DnsError):
                errors.append(answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                found += answer[0]
                ttl = min(ttl, answer[1])
        if not found and errors:
            raise errors[0]
        return found, ttl

    async def _srv(self, name: str, deadline: float) -> tuple[list[AddressPort], float]:
        records, ttl = await self._query(name, "SRV", deadline)
        srv: set[tuple[str, int]] = set()  # (target, port)
        for record in records:
            _priority, _weight, port, target = record.split()
            srv.add((target, int(port)))
        if len(srv) > self.config.max_hosts:
            raise TooManyRecords(len(srv))
        answers = await self._targets(sorted({t for t, _ in srv}), deadline)
        known: dict[str, list[str]] = {}
        unanswered: dict[str, DnsError] = {}
        for target, answer in answers.items():
            if isinstance(answer, DnsError):
                unanswered[target] = answer
                if target in self._known:
                    known[target] = self._known[target]
            else:
                known[target], ttl = answer[0], min(ttl, answer[1])
        if len(unanswered) == len(answers) and answers:
            first = next(iter(unanswered.values()))
            raise DnsError(f"{name}: none of its {len(answers)} SRV targets answered ({first})")
        self._known = known
        self._note(unanswered, len(answers))
        return [(a, port) for target, port in srv for a in known.get(target, ())], ttl

    async def _targets(
        self, targets: list[str], deadline: float
    ) -> dict[str, tuple[list[str], float] | DnsError]:
        """Each target's addresses, or why it has none this round: resolved side by side
        (bounded), until the round's deadline."""
        gate = asyncio.Semaphore(MAX_CONCURRENT_TARGETS)

        async def one(target: str) -> tuple[list[str], float]:
            async with gate:
                return await self._addresses(target, deadline)

        async with TaskScope(log_failures=False) as scope:  # each error is a target's answer
            tasks = {target: scope.spawn(one(target), "dns_target") for target in targets}
            if tasks:
                loop = asyncio.get_running_loop()
                await asyncio.wait(tasks.values(), timeout=max(0.0, deadline - loop.time()))
        answers: dict[str, tuple[list[str], float] | DnsError] = {}
        for target, task in tasks.items():
            if task.cancelled():
                answers[target] = DnsError(f"{target}: no answer within this round")
            elif isinstance(error := task.exception(), DnsError):
                answers[target] = error
            elif error is not None:
                raise error  # a bug: the runner logs it and starts the source again
            else:
                answers[target] = task.result()
        return answers

    def _note(self, unanswered: dict[str, DnsError], targets: int) -> None:
        """Log the targets that did not answer, when they are not those logged last."""
        names = sorted(unanswered)
        if names == self._unanswered:
            return
        self._unanswered = names
        if names:
            log.warning(
                "dns_targets_unanswered",
                source=self.stats.name,
                unanswered=len(names),
                targets=targets,
                first=names[:LOGGED_TARGETS],
                error=str(unanswered[names[0]]),
                kept=sum(1 for name in names if name in self._known),
            )
        else:
            log.info("dns_targets_answered", source=self.stats.name, targets=targets)
