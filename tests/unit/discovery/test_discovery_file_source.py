"""The file source: read and parsed in the offload thread, never on the event loop; bytes
already parsed are not parsed again; a file over its size bound or listing more than
`max_hosts` hosts is refused (the last hosts stay), logged once per outage."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from gateway import config as gateway_config
from gateway.config import FileDiscovery
from gateway.core.offload import Offload
from gateway.discovery import file as file_module
from gateway.discovery.file import BYTES_PER_HOST, FileSource, max_file_bytes
from gateway.discovery.source import Discovered
from tests.support.waits import until


def url(i: int) -> str:
    return f"grpc://10.0.{i // 250}.{i % 250 + 1}:30000?model=m&runtime=sglang"


class Run:
    """A file source running on a file of the test's, what it reports kept in order, and
    the calls of `read` and `parse` it made (with the thread each ran in)."""

    def __init__(self, source: FileSource) -> None:
        self.source = source
        self.reports: list[list[str]] = []
        self.reads: list[int] = []  # thread ids
        self.parses: list[int] = []

    def report(self, hosts: Sequence[Discovered]) -> None:
        self.reports.append([h.spec.address for h in hosts])


@contextlib.asynccontextmanager
async def running(
    path: Path, monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> AsyncIterator[Run]:
    offload = Offload()
    config = FileDiscovery(source="file", path=str(path), interval_s=0.01, **settings)
    run = Run(FileSource(config, offload))
    read, parse = file_module.read, file_module.parse

    def counted_read(*args: Any) -> bytes:
        run.reads.append(threading.get_ident())
        return read(*args)

    def counted_parse(*args: Any) -> Any:
        run.parses.append(threading.get_ident())
        return parse(*args)

    monkeypatch.setattr(file_module, "read", counted_read)
    monkeypatch.setattr(file_module, "parse", counted_parse)
    task = asyncio.ensure_future(run.source.run(run.report))
    try:
        yield run
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        offload.close()


def write(path: Path, text: str) -> None:
    """Write and rename (a new inode), as an editor or a ConfigMap update does."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


async def test_the_file_is_parsed_off_the_event_loop_and_the_same_bytes_only_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "workers.yaml"
    write(path, yaml.safe_dump([url(1)]))
    async with running(path, monkeypatch) as run:
        await until(lambda: len(run.reports) == 1)
        loop_thread = threading.get_ident()
        assert run.parses and loop_thread not in run.parses + run.reads
        # The same bytes with another mtime, then in another inode: read, not parsed.
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        reads = len(run.reads)
        await until(lambda: len(run.reads) > reads)
        write(path, yaml.safe_dump([url(1)]))
        reads = len(run.reads)
        await until(lambda: len(run.reads) > reads)
        assert len(run.parses) == 1 and len(run.reports) == 1
        write(path, yaml.safe_dump([url(1), url(2)]))  # other bytes: parsed, reported
        await until(lambda: len(run.reports) == 2)
        assert run.reports[-1] == ["10.0.0.2:30000", "10.0.0.3:30000"]
        assert len(run.parses) == 2 and loop_thread not in run.parses + run.reads
        assert run.source.stats.errors == 0 and run.source.stats.updates == 2


async def test_more_entries_than_max_hosts_are_refused_unvalidated_and_the_hosts_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "workers.yaml"
    write(path, yaml.safe_dump([url(1), url(2)]))
    validated: list[int] = []

    def counted(data: Any) -> Any:
        validated.append(1)
        return gateway_config.parse_worker_list(data)

    monkeypatch.setattr(file_module, "parse_worker_list", counted)
    with capture_logs() as logs:
        async with running(path, monkeypatch, max_hosts=2) as run:
            await until(lambda: len(run.reports) == 1)
            write(path, yaml.safe_dump({"workers": [url(i) for i in range(1, 5)]}))
            await until(lambda: run.source.stats.errors >= 3)
            assert len(run.reports) == 1 and run.source.stats.hosts == 2
            assert len(validated) == 1  # the refused entries were counted, not validated
            assert len(run.parses) == 2  # refused bytes are not parsed again at each check
            write(path, yaml.safe_dump([url(3)]))
            await until(lambda: len(run.reports) == 2)
    assert run.reports[-1] == ["10.0.0.4:30000"]
    refused = [e for e in logs if e["event"] == "discovery_too_many_hosts"]
    assert len(refused) == 1  # once per outage
    assert refused[0]["source"] == f"file:{path}"
    assert (refused[0]["hosts"], refused[0]["max_hosts"], refused[0]["hosts_kept"]) == (4, 2, 2)
    assert [e["event"] for e in logs].count("discovery_recovered") == 1


async def test_a_file_over_its_size_bound_is_refused_without_being_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "workers.yaml"
    write(path, yaml.safe_dump([url(1)]))
    with capture_logs() as logs:
        async with running(path, monkeypatch, max_hosts=2) as run:
            await until(lambda: len(run.reports) == 1)
            reads = len(run.reads)
            write(path, yaml.safe_dump([url(1)]) + "#" * (2 * BYTES_PER_HOST))  # a comment
            await until(lambda: run.source.stats.errors >= 2)
            assert len(run.reads) == reads and len(run.reports) == 1
    failed = [e for e in logs if e["event"] == "discovery_failed"]
    assert len(failed) == 1
    assert failed[0]["error"] == f"{path}: larger than {2 * BYTES_PER_HOST} bytes"


def test_the_default_bound_holds_max_hosts_long_entries() -> None:
    """64 KiB by default; 256 mapping entries with a long model name and every key fit."""
    assert max_file_bytes(FileDiscovery(source="file", path="x").max_hosts) == 64 * 1024
    model = "meta-llama/Llama-3.1-70B-Instruct"
    entries = [
        {
            "url": f"grpc://10.{i}.234.245:30000",
            "model": model,
            "runtime": "sglang",
            "role": "prefill",
            "bootstrap_port": 8998,
        }
        for i in range(256)
    ]
    assert len(yaml.safe_dump({"workers": entries}).encode()) <= max_file_bytes(256)
