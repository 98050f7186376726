"""File discovery: a YAML file listing workers (the `--worker` URL syntax, or `workers:`
entries), read again when it changes.

Polled every `interval_s` (its modification time, size and inode: an editor's
write-and-rename counts), which works on every filesystem and in containers where
inotify does not see a ConfigMap's symlink swap. A file that is missing, unreadable or
does not parse keeps the previous hosts; that is logged once until a good read.

Reading it costs the event loop nothing: the file is read and parsed (YAML, then each
entry validated) in the gateway's offload thread, and bytes already parsed are not parsed
again, whatever its modification time says (a save without changes, a ConfigMap resync).
Its size is bounded, BYTES_PER_HOST for each of `max_hosts` (64 KiB by default), because
parsing holds the GIL even in a thread: a 1 MiB file kept the event loop waiting ~0.5 s
a read, 64 KiB of worker URLs takes ~20 ms of parsing (libyaml) and ~25 ms of validation.
A worker URL is some 50 to 120 bytes, so the bound holds `max_hosts` entries with room
for mappings and comments.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from gateway.config import ConfigError, FileDiscovery, parse_worker_list
from gateway.core.offload import Offload
from gateway.discovery.source import Discovered, Report, SourceStats, publish

BYTES_PER_HOST = 256
# libyaml's parser where PyYAML was built with it (ten times faster), else PyYAML's own.
LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def max_file_bytes(max_hosts: int) -> int:
    """The largest file a source that may report `max_hosts` hosts reads."""
    return max_hosts * BYTES_PER_HOST


def digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class Parsed:
    """What one version of the file says: its hosts, or why it gives none (`error`, or
    `listed` entries, more than `max_hosts`)."""

    hosts: tuple[Discovered, ...] = ()
    error: str = ""
    listed: int = 0


def parse(raw: bytes, path: str, label: str, max_hosts: int) -> Parsed:
    """The file's bytes as hosts (in the offload thread: it takes milliseconds). Entries
    are counted before they are validated: a list over `max_hosts` costs no more."""
    try:
        data = yaml.load(raw.decode(), Loader=LOADER)
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        return Parsed(error=f"{path}: {exc}".replace("\n", " "))
    entries = data["workers"] if isinstance(data, Mapping) and set(data) == {"workers"} else data
    if isinstance(entries, list) and len(entries) > max_hosts:
        return Parsed(listed=len(entries))
    try:
        specs = parse_worker_list(data)
    except ConfigError as exc:
        return Parsed(error=f"{path}: {exc}")
    return Parsed(hosts=tuple(Discovered(spec, label) for spec in specs))


def read(path: str, limit: int) -> bytes:
    """The file's bytes, at most `limit` of them (in the offload thread: a slow disk or
    network filesystem must not hold up the event loop)."""
    with open(path, "rb") as file:
        raw = file.read(limit + 1)
    if len(raw) > limit:
        raise ConfigError(f"{path}: larger than {limit} bytes")
    return raw


class FileSource:
    def __init__(self, config: FileDiscovery, offload: Offload) -> None:
        self.config = config
        self.stats = SourceStats(config.label)
        self._offload = offload
        self._limit = max_file_bytes(config.max_hosts)
        self._parsed: tuple[bytes, Parsed] | None = None  # the last bytes parsed (digest)

    async def run(self, report: Report) -> None:
        seen: tuple[int, int, int] | None = None
        in_force: bytes | None = None  # the digest of the bytes whose hosts stand, reported
        while True:
            try:
                stat = os.stat(self.config.path)
                version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
                if version != seen:
                    if stat.st_size > self._limit:  # refused without reading it
                        raise ConfigError(f"{self.config.path}: larger than {self._limit} bytes")
                    raw = await self._offload.run(read, self.config.path, self._limit)
                    seen, key = version, digest(raw)
                    if key != in_force:
                        in_force = key if await self._apply(key, raw, report) else None
            except (OSError, ConfigError) as exc:
                self.stats.failed(str(exc))
                in_force = None  # the next good read is reported, ending the outage
            if in_force is None:
                seen = None  # read it again next time, whatever its stat says
            await asyncio.sleep(self.config.interval_s)

    async def _apply(self, key: bytes, raw: bytes, report: Report) -> bool:
        """Report what the bytes (digest `key`) say, parsed unless they were the last
        bytes parsed; False if they say no hosts (counted as a failure)."""
        if self._parsed is None or self._parsed[0] != key:
            c = self.config
            parsed = await self._offload.run(parse, raw, c.path, c.label, c.max_hosts)
            self._parsed = (key, parsed)
        parsed = self._parsed[1]
        if parsed.error:
            self.stats.failed(parsed.error)
            return False
        if parsed.listed:
            self.stats.too_many(parsed.listed, self.config.max_hosts)
            return False
        return publish(report, self.stats, parsed.hosts, self.config.max_hosts)
