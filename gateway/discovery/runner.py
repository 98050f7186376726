"""Running the configured sources: each in a supervised task of its own (restarted a second
after an unexpected error, logged once while it repeats), its reports passed on with its
name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from gateway.config import DiscoverySource, DnsDiscovery, FileDiscovery, KubernetesDiscovery
from gateway.core.offload import Offload
from gateway.core.tasks import TaskScope
from gateway.discovery.source import Discovered, Source, SourceStats

Sink = Callable[[str, Sequence[Discovered]], None]  # (source name, its hosts now)


def make_source(config: DiscoverySource, offload: Offload) -> Source:
    """The source a `discovery:` entry describes (the Kubernetes client is imported only
    when a Kubernetes source is configured); `offload`: the thread a file is parsed in."""
    if isinstance(config, DnsDiscovery):
        from gateway.discovery.dns import DnsSource

        return DnsSource(config)
    if isinstance(config, FileDiscovery):
        from gateway.discovery.file import FileSource

        return FileSource(config, offload)
    assert isinstance(config, KubernetesDiscovery)
    from gateway.discovery.kubernetes import KubernetesSource

    return KubernetesSource(config)


def grace_by_source(configs: Sequence[DiscoverySource]) -> dict[str, float]:
    """How long each source's hosts may stay out of service before they leave."""
    return {c.label: c.unready_grace_s for c in configs if isinstance(c, KubernetesDiscovery)}


class Sources:
    """The configured sources, run until `close`. `offload`: the thread that parses what
    they read (the gateway's; without one, their own, closed with them)."""

    def __init__(self, configs: Sequence[DiscoverySource], offload: Offload | None = None) -> None:
        self.names = [config.label for config in configs]
        thread = offload if offload is not None else Offload()
        self._own = None if offload is not None else thread
        self._sources = [make_source(config, thread) for config in configs]
        self._tasks = TaskScope()

    @property
    def stats(self) -> list[SourceStats]:
        return [source.stats for source in self._sources]

    def start(self, sink: Sink) -> None:
        for name, source in zip(self.names, self._sources, strict=True):
            self._tasks.supervise("discovery_source", _runner(name, source, sink), source=name)

    async def close(self) -> None:
        await self._tasks.close()
        if self._own is not None:
            self._own.close()


def _runner(name: str, source: Source, sink: Sink) -> Callable[[], Awaitable[None]]:
    """`source` run once, its reports passed on under its name (the supervised loop)."""

    def report(hosts: Sequence[Discovered]) -> None:
        sink(name, hosts)

    return lambda: source.run(report)
