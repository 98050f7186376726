"""The discovery attacks: a file source listing 2,000 hosts on closed ports (`many-hosts`),
a large workers file rewritten every second (`file-source`), DNS SRV targets that do not
resolve (`dns-srv`)."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from pathlib import Path
from typing import Any

from grpc import aio

from gateway_sim.client import (
    closed_port,
)
from gateway_sim.dnsmasq import Dnsmasq
from gateway_sim.launch import Child
from scripts.attacks.harness import STATE_WAIT_S, Scenario, until


def closed_ports(scenario: Scenario, count: int) -> list[int]:
    """Ports nobody listens on (bound, never listening, held until the run ends)."""
    sockets = [closed_port() for _ in range(count)]
    for sock in sockets:
        scenario.run.on_exit(sock.close)
    return [int(sock.getsockname()[1]) for sock in sockets]


def closed_url(port: int, model: str) -> str:
    return f"grpc://127.0.0.1:{port}?model={model}&runtime=sglang"


def write_atomically(path: Path, text: str) -> None:
    """Write and rename, as an editor or a ConfigMap update does."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


class FileHosts(Scenario):
    """A file discovery source whose file the attack rewrites (model `fm`)."""

    def file_config(self, first: str) -> dict[str, Any]:
        self.path = self.run.dir / "workers.yaml"
        write_atomically(self.path, f"- {first}\n")
        source = {"source": "file", "path": str(self.path), "interval_s": 1}
        return {"discovery": [source], "discovery_timeout_s": 2}

    async def listed(self) -> set[str]:
        """The workers the file source put in (ids)."""
        workers = await self.run.listed_workers()
        return {w.id for w in workers.values() if w.model == "fm"}


class ManyHosts(FileHosts):
    name = "many-hosts"
    summary = "a file source listing 2,000 hosts on closed ports, then one host again"
    HOSTS = 2_000

    async def prepare(self) -> Child:
        self.run.workers()
        self.first = closed_ports(self, 1)[0]
        return self.run.gateway(self.file_config(closed_url(self.first, "fm")))

    async def begin(self) -> None:
        # Taken once every process is up: select() in the launcher takes no fd past 1023.
        ports = closed_ports(self, self.HOSTS)
        urls = "".join(f"- {closed_url(p, 'fm')}\n" for p in ports)
        write_atomically(self.path, urls)
        self.most = self.unanswered = 0
        self.joined_s = math.nan
        self.run.spawn(self.watch(asyncio.get_running_loop().time()))

    async def watch(self, since: float) -> None:
        while True:
            try:
                listed = len(await self.listed())
            except aio.AioRpcError:  # the admin port of a stalled gateway: ask again
                self.unanswered += 1
                continue
            self.most = max(self.most, listed)
            if listed >= self.HOSTS and math.isnan(self.joined_s):
                self.joined_s = asyncio.get_running_loop().time() - since
            await asyncio.sleep(1.0)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        joined = f"all {self.HOSTS} after {self.joined_s:.1f} s"
        if math.isnan(self.joined_s):
            joined = f"never all {self.HOSTS}"
        if self.unanswered:
            joined += f"; ListWorkers got no answer within 10 s, {self.unanswered} times"
        self.note("hosts listed at most", f"{self.most} ({joined})")
        write_atomically(self.path, f"- {closed_url(self.first, 'fm')}\n")
        loop = asyncio.get_running_loop()
        since = loop.time()

        async def one_left() -> bool:
            return len(await self.listed()) == 1

        left = await until(one_left, STATE_WAIT_S * 1.5, every_s=0.5)
        shown = f"{loop.time() - since:.1f} s" if left else "NOT within 30 s"
        self.note("back to one host", shown)


class FileSource(FileHosts):
    name = "file-source"
    summary = "a ~1 MiB workers file (one host, the rest comments) rewritten every second"
    FILE_BYTES = 1_000_000  # under the file source's 1 MiB bound

    async def prepare(self) -> Child:
        self.run.workers()
        self.ports = closed_ports(self, 2)
        return self.run.gateway(self.file_config(closed_url(self.ports[0], "fm")))

    def big_file(self, nonce: int) -> str:
        head = f"- {closed_url(self.ports[0], 'fm')}\n"
        line = f"# padding {nonce:08d} " + "x" * 60 + "\n"
        return head + line * ((self.FILE_BYTES - len(head)) // len(line))

    async def begin(self) -> None:
        self.writes = 0
        self.run.spawn(self.rewrite())

    async def rewrite(self) -> None:
        while True:
            await asyncio.to_thread(write_atomically, self.path, self.big_file(self.writes))
            self.writes += 1
            await asyncio.sleep(1.0)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        self.note("rewrites", f"{self.writes} of {len(self.big_file(0)):,} bytes")
        other = f"127.0.0.1:{self.ports[1]}"
        write_atomically(self.path, f"- {closed_url(self.ports[1], 'fm')}\n")

        async def read_again() -> bool:
            return other in await self.listed()

        read = await until(read_again, STATE_WAIT_S, every_s=0.25)
        self.note("the last (small) file read", "yes" if read else "NOT within 20 s")


DNS_NAME = "attack.test"


class DnsSrv(Scenario):
    name = "dns-srv"
    summary = "20 SRV targets, 5 of which do not resolve (dnsmasq)"
    TARGETS = 20
    RESOLVING = 15

    def unavailable(self) -> str | None:
        if shutil.which("dnsmasq") or Path("/usr/sbin/dnsmasq").exists():
            return None
        return "dnsmasq is not installed (apt-get install -y dnsmasq-base)"

    async def prepare(self) -> Child:
        self.ports = closed_ports(self, self.TARGETS)
        srv = [
            f"--srv-host=_grpc._tcp.{DNS_NAME},t{i}.{DNS_NAME},{port}"
            for i, port in enumerate(self.ports)
        ]
        self.dns = Dnsmasq(self.run.dir, *srv)
        self.dns.start()
        self.run.on_exit(self.dns.stop)
        self.run.workers()
        source = {
            "source": "dns",
            "name": f"_grpc._tcp.{DNS_NAME}",
            "nameserver": self.dns.address,
            "interval_s": 1,
            "model": "d",
            "runtime": "sglang",
        }
        return self.run.gateway({"discovery": [source], "discovery_timeout_s": 1})

    async def begin(self) -> None:
        """No target resolved until now; now all but 5 do."""
        records = {f"t{i}.{DNS_NAME}": ["127.0.0.1"] for i in range(self.RESOLVING)}
        await asyncio.to_thread(self.dns.set, records)
        self.most = 0
        self.run.spawn(self.watch())

    async def watch(self) -> None:
        while True:
            try:
                workers = await self.run.listed_workers()
            except aio.AioRpcError:  # the admin port of a stalled gateway: ask again
                continue
            self.most = max(self.most, sum(1 for w in workers.values() if w.model == "d"))
            await asyncio.sleep(0.5)

    async def end(self) -> None:
        await self.run.cancel_spawned()
        shown = f"{self.most} of {self.RESOLVING} resolvable ({self.TARGETS} SRV targets)"
        self.note("hosts joined", shown, self.most == self.RESOLVING)
