"""DNS discovery (dnspython): a name's A/AAAA records with a configured port, or its SRV
records (each a host and its port), resolved again every `interval_s`, or sooner when
the records' TTL is shorter, never faster than once a second.

A failed resolution (no answer in time, SERVFAIL, NXDOMAIN) and an answer with no
address keep the last known hosts: a DNS outage never empties a cluster. It is logged
once per outage and counted.
"""

from __future__ import annotations

import asyncio

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from gateway.config import DnsDiscovery, WorkerSpec, parse_address
from gateway.discovery.source import Discovered, Report, SourceStats

MIN_INTERVAL_S = 1.0
QUERY_TIMEOUT_S = 2.0  # one resolution's time, all its queries together


class DnsError(Exception):
    """This resolution said nothing usable: the last hosts stay."""


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

    async def run(self, report: Report) -> None:
        interval = self.config.interval_s
        while True:
            wait = interval
            try:
                targets, ttl = await self.resolve()
            except DnsError as exc:
                self.stats.failed(str(exc))
            else:
                hosts = [self._host(address, port) for address, port in targets]
                report(hosts)
                self.stats.succeeded(len(hosts))
                wait = max(MIN_INTERVAL_S, min(interval, ttl))
            await asyncio.sleep(wait)

    def _host(self, address: str, port: int) -> Discovered:
        c = self.config
        spec = WorkerSpec(
            host=address, port=port, model=c.model, runtime=c.runtime, role=c.role, tls=c.tls
        )
        return Discovered(spec, c.label)

    async def resolve(self) -> tuple[list[tuple[str, int]], float]:
        """(address, port) pairs, sorted, and the shortest TTL among the records read."""
        name, port = self.config.name, self.config.port
        if port is not None:
            addresses, ttl = await self._addresses(name)
            targets = [(a, port) for a in addresses]
        else:
            targets, ttl = await self._srv(name)
        if not targets:
            raise DnsError(f"{name} resolves to no address")
        return sorted(set(targets)), ttl

    async def _query(self, name: str, kind: str) -> tuple[list[str], float]:
        """The records' texts and TTL; no records of this kind is an empty answer."""
        try:
            answer = await self._resolver.resolve(name, kind, raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            raise DnsError(f"{name}: no such name (NXDOMAIN)") from None
        except dns.exception.Timeout:
            raise DnsError(f"{name}: no answer within {QUERY_TIMEOUT_S:g} s") from None
        except dns.exception.DNSException as exc:
            raise DnsError(f"{name}: {exc}") from None
        rrset = answer.rrset
        if rrset is None:
            return [], float("inf")
        return [record.to_text() for record in rrset], float(rrset.ttl)

    async def _addresses(self, name: str) -> tuple[list[str], float]:
        """A and AAAA records: one kind failing (a server refusing AAAA for a name it
        only has A records for) is no failure while the other answers."""
        found: list[str] = []
        ttl = float("inf")
        errors: list[DnsError] = []
        answers = await asyncio.gather(
            self._query(name, "A"), self._query(name, "AAAA"), return_exceptions=True
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

    async def _srv(self, name: str) -> tuple[list[tuple[str, int]], float]:
        records, ttl = await self._query(name, "SRV")
        targets: list[tuple[str, int]] = []
        for record in records:
            _priority, _weight, port, target = record.split()
            addresses, target_ttl = await self._addresses(target)
            ttl = min(ttl, target_ttl)
            targets += [(a, int(port)) for a in addresses]
        return targets, ttl
