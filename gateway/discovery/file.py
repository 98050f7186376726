"""File discovery: a YAML file listing workers (the `--worker` URL syntax, or `workers:`
entries), read again when it changes.

Polled every `interval_s` (its modification time, size and inode: an editor's
write-and-rename counts), which works on every filesystem and in containers where
inotify does not see a ConfigMap's symlink swap. A file that is missing, unreadable or
does not parse keeps the previous hosts; that is logged once until a good read.
"""

from __future__ import annotations

import asyncio
import os

import yaml

from gateway.config import ConfigError, FileDiscovery, parse_worker_list
from gateway.discovery.source import Discovered, Report, SourceStats

MAX_FILE_BYTES = 1024 * 1024


class FileSource:
    def __init__(self, config: FileDiscovery) -> None:
        self.config = config
        self.stats = SourceStats(config.label)

    async def run(self, report: Report) -> None:
        seen: tuple[int, int, int] | None = None
        while True:
            try:
                stat = os.stat(self.config.path)
                version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
                if version != seen:
                    hosts = self.read()
                    seen = version
                    report(hosts)
                    self.stats.succeeded(len(hosts))
            except (OSError, ConfigError) as exc:
                self.stats.failed(str(exc))
                seen = None  # read it again once it is back, whatever its stat says
            await asyncio.sleep(self.config.interval_s)

    def read(self) -> list[Discovered]:
        path = self.config.path
        with open(path, "rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        try:
            data = yaml.safe_load(raw.decode())
        except (UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: {exc}".replace("\n", " ")) from None
        try:
            specs = parse_worker_list(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        return [Discovered(spec, self.config.label) for spec in specs]
