"""A real DNS server for the discovery tests: dnsmasq (Debian's dnsmasq-base) on a
loopback UDP/TCP port, answering from a hosts file the test rewrites (`set`, which sends
SIGHUP: dnsmasq reads the file again). TTL 1 s, no upstream, no cache of its own
answers beyond that."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.resolver

from gateway_sim.client import WAIT_S


def free_port() -> int:
    """A port free for UDP and TCP on 127.0.0.1 (dnsmasq binds both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port for dnsmasq")


class Dnsmasq:
    def __init__(self, directory: Path, *extra: str) -> None:
        """`extra`: more dnsmasq options (e.g. `--srv-host=...`, read at start only)."""
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        self.hosts = directory / "hosts"
        self.log = directory / "dnsmasq.log"  # one line per query received
        self.port = free_port()
        self._generation = 0
        self._records: dict[str, list[str]] = {}
        self._write()
        self._args = [
            binary,
            "--keep-in-foreground",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts}",
            "--local-ttl=1",
            "--pid-file=",
            "--conf-file=/dev/null",
            f"--user={_user()}",
            "--log-queries",
            f"--log-facility={self.log}",
            *extra,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            self._wait_answering()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited in time; reaped either way."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def set(self, records: Mapping[str, Sequence[str]]) -> None:
        """Name -> addresses, replacing every record; returns once dnsmasq answers with
        them (it reads the file again on SIGHUP)."""
        self._records = {name: list(addresses) for name, addresses in records.items()}
        self._write()
        if self.process is not None:
            self.process.send_signal(signal.SIGHUP)
            self._wait_answering()

    def _write(self) -> None:
        """The records, and `gen-N.ready`: resolvable once this version is read."""
        self._generation += 1
        lines = [f"127.0.0.254 gen-{self._generation}.ready"]
        lines += [f"{a} {name}" for name, addresses in self._records.items() for a in addresses]
        self.hosts.write_text("".join(line + "\n" for line in lines))

    def queries(self, name: str, kind: str = "A") -> int:
        """Queries for `name` received so far."""
        text = self.log.read_text() if self.log.exists() else ""
        return sum(1 for line in text.splitlines() if f"query[{kind}] {name} " in line)

    def resolve(self, name: str) -> list[str]:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port, resolver.lifetime = ["127.0.0.1"], self.port, 1.0
        answer = resolver.resolve(name, "A", raise_on_no_answer=False)
        return sorted(r.to_text() for r in answer.rrset) if answer.rrset is not None else []

    def _wait_answering(self) -> None:
        """Until the current version of the file answers (bounded)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                if self.resolve(f"gen-{self._generation}.ready"):
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise AssertionError("dnsmasq did not read its hosts file")
            time.sleep(0.02)


def _user() -> str:
    """dnsmasq drops root for `nobody` by default, who could not read the test's file."""
    return pwd.getpwuid(os.getuid()).pw_name
