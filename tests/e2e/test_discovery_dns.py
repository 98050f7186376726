"""DNS discovery against a real DNS server (dnsmasq), with `gateway serve` and simulated
workers as real processes: the workers listen on 127.0.0.2 and 127.0.0.3 with one port,
the name's A records say which of them exist."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gateway.config import DnsDiscovery
from gateway.discovery.dns import LOGGED_TARGETS, ROUND_TIMEOUT_S, AddressPort, DnsError, DnsSource
from gateway.discovery.source import Discovered
from gateway_sim.client import (
    admin_address,
    channel,
    collect,
    list_workers,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health,
    write_config,
)
from gateway_sim.dnsmasq import Dnsmasq
from tests.support.launch import Launcher
from tests.support.processes import per_process
from tests.support.waits import WAIT_S

NAME = "workers.llm.test"
A, B = "127.0.0.2", "127.0.0.3"
INTERVAL_S = 1.0


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def shared_port() -> int:
    """A TCP port free on both loopback addresses (the records carry no port)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind((A, 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind((B, port))
                except OSError:
                    continue
        return port
    raise RuntimeError("no port free on both addresses")


def start_workers(sim: Launcher, port: int, *addresses: str, **flags: str) -> None:
    extra = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)]
    for address in addresses:
        sim("--listen", f"{address}:{port}", "--model", "m", "--name", address, *extra)


def serve(gateway: Launcher, tmp_path: Path, dnsmasq: Dnsmasq, port: int, *args: str) -> Any:
    config = {
        "discovery": [
            {
                "source": "dns",
                "name": NAME,
                "port": port,
                "nameserver": dnsmasq.address,
                "interval_s": INTERVAL_S,
                "model": "m",
                "runtime": "sglang",
            }
        ],
        # manual: round robin unless a call names its worker (x-target-worker)
        "models": {"m": {"policy": "manual"}},
        "metrics": {"listen": "127.0.0.1:0"},
    }
    return gateway("--config", write_config(tmp_path, config), *args)


async def served_by(stub: Any, request_id: str, *target: str) -> str:
    metadata = model_md("m", *(("x-target-worker", t) for t in target))
    call = stub.Generate(sgl_generate(request_id, tokens=1), metadata=metadata, timeout=5)
    _, error = await collect(call)
    assert error is None, error
    return str(dict(await call.initial_metadata())["x-sim-worker"])


async def test_a_record_added_gets_calls_within_the_interval_and_one_removed_none_after(
    sim: Launcher, gateway: Launcher, dnsmasq: Dnsmasq, tmp_path: Path
) -> None:
    port = shared_port()
    start_workers(sim, port, A, B, tokens="40", token_ms="50")  # a stream lasts 2 s
    dnsmasq.set({NAME: [A]})
    gw = serve(gateway, tmp_path, dnsmasq, port)
    await wait_health(gw.address, "m")
    workers = await list_workers(admin_address(gw))
    assert list(workers) == [f"{A}:{port}"]
    assert list(workers[f"{A}:{port}"].sources) == [f"dns:{NAME}"]
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        dnsmasq.set({NAME: [A, B]})
        added = time.monotonic()
        seen: set[str] = set()
        while B not in seen:
            assert time.monotonic() - added <= INTERVAL_S + 1.0, "B got no call in time"
            seen.add(await served_by(stub, f"add-{len(seen)}-{time.monotonic()}"))
        took = time.monotonic() - added
        # A stream on B while B leaves DNS: it completes intact.
        stream = stub.Generate(
            sgl_generate("long", tokens=40),
            metadata=model_md("m", ("x-target-worker", f"{B}:{port}")),
        )
        assert dict(await stream.initial_metadata())["x-sim-worker"] == B
        dnsmasq.set({NAME: [A]})
        removed = time.monotonic()
        await asyncio.sleep(INTERVAL_S + 1.0 - (time.monotonic() - removed))
        after = [await served_by(stub, f"after-{i}") for i in range(6)]
        assert after == [A] * 6
        messages, error = await collect(stream)
        kinds = [m.WhichOneof("response") for m in messages]
        assert error is None and kinds == ["chunk"] * 40 + ["complete"]  # intact, then OK
    print(f"added host served after {took:.2f} s (limit {INTERVAL_S + 1.0:g} s)")


async def test_a_dns_outage_keeps_every_host_and_every_call_succeeds(
    sim: Launcher, gateway: Launcher, dnsmasq: Dnsmasq, tmp_path: Path
) -> None:
    port = shared_port()
    start_workers(sim, port, A, B)
    dnsmasq.set({NAME: [A, B]})
    gw = serve(gateway, tmp_path, dnsmasq, port)
    await wait_health(gw.address, "m")
    admin = admin_address(gw)
    assert sorted(await list_workers(admin)) == [f"{A}:{port}", f"{B}:{port}"]
    dnsmasq.stop()
    down = time.monotonic()
    served: list[str] = []
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        while time.monotonic() - down < 10.0:
            served.append(await served_by(stub, f"out-{len(served)}"))
            assert sorted(await list_workers(admin)) == [f"{A}:{port}", f"{B}:{port}"]
            await asyncio.sleep(0.2)
    assert set(served) == {A, B} and len(served) >= 20
    metrics = f"http://127.0.0.1:{gw.port_of('metrics')}/metrics"
    text = await asyncio.to_thread(_get, metrics)
    errors = _sample(text, "gateway_discovery_errors_total", f"dns:{NAME}")
    # Each failed resolution counted: one every query timeout (2 s) plus the interval.
    assert errors >= 2
    assert _sample(text, "gateway_discovery_hosts", f"dns:{NAME}") == 2
    assert _sample(text, "gateway_discovery_seconds_since_success", f"dns:{NAME}") >= 9
    last = _sample(text, "gateway_discovery_last_success_timestamp_seconds", f"dns:{NAME}")
    assert 9 <= time.time() - last < 600


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _sample(text: str, name: str, source: str) -> float:
    prefix = f'{name}{{source="{source}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"no {prefix!r} in the metrics")


async def test_with_two_processes_one_resolver_feeds_both(
    sim: Launcher, gateway: Launcher, dnsmasq: Dnsmasq, tmp_path: Path
) -> None:
    port = shared_port()
    start_workers(sim, port, A, B)
    dnsmasq.set({NAME: [A]})
    gw = serve(gateway, tmp_path, dnsmasq, port, "--processes", "2")
    await wait_health(gw.address, "m")
    channels = await per_process(gw)
    try:
        dnsmasq.set({NAME: [A, B]})
        added = time.monotonic()
        for ch in channels.values():  # each process places a call on B
            stub = sgl_grpc.SglangSchedulerStub(ch)
            while True:
                try:
                    assert await served_by(stub, "b", f"{B}:{port}") == B
                    break
                except AssertionError:
                    assert time.monotonic() - added <= INTERVAL_S + 1.0, "B not used in time"
                    await asyncio.sleep(0.05)
        # One resolver in all: about one query a second, not one per process.
        before, start = dnsmasq.queries(NAME), time.monotonic()
        await asyncio.sleep(4.0)
        asked = dnsmasq.queries(NAME) - before
        assert 2 <= asked <= 5, f"{asked} queries in {time.monotonic() - start:.1f} s"
    finally:
        for ch in channels.values():
            await ch.close()


async def resolved(source: DnsSource) -> tuple[list[AddressPort], float]:
    """One resolution of the source's name, tried again after a round whose targets did
    not answer in time (a loaded machine), bounded: the content is what a test checks."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return await source.resolve()
        except DnsError:
            if time.monotonic() > deadline:
                raise


async def test_srv_records_give_each_host_its_port_and_aaaa_records_count(tmp_path: Path) -> None:
    """The source alone against dnsmasq: SRV targets resolved to their A and AAAA records,
    each with the SRV record's port."""
    server = Dnsmasq(
        tmp_path,
        f"--srv-host=_grpc._tcp.{NAME},a.{NAME},30001",
        f"--srv-host=_grpc._tcp.{NAME},b.{NAME},30002",
    )
    server.start()
    try:
        server.set({f"a.{NAME}": [A, "::1"], f"b.{NAME}": [B]})
        config = DnsDiscovery(
            source="dns", name=f"_grpc._tcp.{NAME}", nameserver=server.address, model="m"
        )
        targets, ttl = await resolved(DnsSource(config))
        assert targets == [("127.0.0.2", 30001), ("127.0.0.3", 30002), ("::1", 30001)]
        assert ttl <= 1  # dnsmasq's --local-ttl: resolved again within a second
        reports: list[list[str]] = []
        reported = asyncio.Event()

        def report(hosts: Sequence[Discovered]) -> None:
            reports.append([h.spec.address for h in hosts])
            reported.set()

        source = DnsSource(config)
        task = asyncio.ensure_future(source.run(report))
        await asyncio.wait_for(reported.wait(), WAIT_S)  # a round that failed is tried again
        task.cancel()
        assert reports[0] == ["127.0.0.2:30001", "127.0.0.3:30002", "[::1]:30001"]
        assert source.stats.hosts == 3 and source.stats.errors == 0
    finally:
        server.stop()


async def test_srv_targets_that_do_not_answer_cost_the_others_nothing(tmp_path: Path) -> None:
    """20 SRV targets: 12 resolve, 4 are refused (no such record) and 4 never answer
    (dnsmasq forwards their domain to a UDP port nobody answers on). One round reports
    the 12, within one bound for the round, and names the 8 in one log line."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # never read: no answer
    silent.bind(("127.0.0.1", 0))
    hidden = "slow.test"
    targets = [f"t{i}.{NAME}" for i in range(16)] + [f"s{i}.{hidden}" for i in range(4)]
    server = Dnsmasq(
        tmp_path,
        f"--server=/{hidden}/127.0.0.1#{silent.getsockname()[1]}",
        *(f"--srv-host=_grpc._tcp.{NAME},{t},{30000 + i}" for i, t in enumerate(targets)),
    )
    server.start()
    try:
        server.set({t: [A] for t in targets[:12]})
        config = DnsDiscovery(
            source="dns", name=f"_grpc._tcp.{NAME}", nameserver=server.address, model="m"
        )
        source = DnsSource(config)
        started = time.monotonic()
        with capture_logs() as logs:
            found, _ttl = await source.resolve()
        took = time.monotonic() - started
        assert found == [(A, 30000 + i) for i in range(12)]
        (line,) = [e for e in logs if e["event"] == "dns_targets_unanswered"]
        assert line["unanswered"] == 8 and line["targets"] == 20
        assert line["first"] == sorted(f"{t}." for t in targets[12:])[:LOGGED_TARGETS]
        assert server.queries(f"s0.{hidden}") >= 1  # asked, and forwarded: no answer came
    finally:
        server.stop()
        silent.close()
    print(f"a round of 20 targets, 4 silent: {took:.2f} s (round bound {ROUND_TIMEOUT_S:g} s)")
