"""The front's own bounds, as pure logic: admission per caller, the read gate's turns,
header values that may go upstream, peer addresses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gateway.app.connections import peer_ip
from gateway.config import build_config
from gateway.core.address import peer_host
from gateway.proxy.admission import Admission, Refusal
from gateway.proxy.intake import ReadGate
from gateway.proxy.metadata import forwardable_value, read_request_meta


def test_admission_keeps_a_share_for_other_callers() -> None:
    admission = Admission(limit=4, per_caller=2)
    assert admission.enter("a") is None
    assert admission.enter("a") is None
    assert admission.enter("a") is Refusal.CALLER_FULL
    assert admission.enter("b") is None
    assert admission.enter("b") is None
    assert admission.enter("c") is Refusal.GATEWAY_FULL
    admission.leave("a")
    assert admission.enter("c") is None
    for caller in ("a", "b", "b", "c"):
        admission.leave(caller)
    assert admission.active == 0 and admission.callers == 0


def test_the_default_share_is_a_quarter_of_the_gateway() -> None:
    assert build_config().limits.principal_share == 1024
    limits = build_config({"limits": {"max_inflight_requests": 2}}).limits
    assert limits.principal_share == 1
    explicit = build_config({"limits": {"max_inflight_per_principal": 7}}).limits
    assert explicit.principal_share == 7


@pytest.mark.parametrize(
    ("key", "value", "ok"),
    [
        ("x-a", "plain value ~!", True),
        ("x-a", "café", False),
        ("x-a", "a\tb", False),
        ("x-a", "a\r\nb", False),
        ("x-a", "a\x00b", False),
        ("x-a", "a\x1bb", False),
        ("x-a", "a\x7fb", False),
        ("x-a-bin", b"\x00\xff", True),
        ("x-a-bin", "café", True),
    ],
)
def test_forwardable_values(key: str, value: str | bytes, ok: bool) -> None:
    assert forwardable_value(key, value) is ok


def test_the_first_bad_key_is_named_and_private_keys_are_not_judged() -> None:
    meta = read_request_meta(
        [("authorization", "Bearer \x00"), ("x-model-id", "m"), ("x-b", "é"), ("x-c", "\t")],
        ("x-model-id",),
        "x-routing-key",
        "x-target-worker",
        frozenset({"authorization"}),
    )
    assert meta.bad_key == "x-b"
    assert meta.model == "m"


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.1:5555", "10.0.0.1"),
        ("ipv6:[::1]:5555", "[::1]"),
        ("unix:/tmp/sock", "unix:/tmp/sock"),
        ("", "unknown"),
        (None, "unknown"),
    ],
)
def test_peer_host(peer: str | None, host: str) -> None:
    assert peer_host(peer) == host


@contextlib.asynccontextmanager
async def turn(gate: ReadGate, caller: str) -> AsyncIterator[None]:
    """A turn as `read_request` takes one."""
    if not gate.enter(caller):
        await gate.wait(caller)
    try:
        yield
    finally:
        gate.leave(caller)


async def test_the_read_gate_bounds_reads_in_total_and_per_caller_in_rotation() -> None:
    gate = ReadGate(total=2, per_caller=1)
    order: list[str] = []
    release: dict[str, asyncio.Event] = {}

    async def read(caller: str, name: str) -> None:
        async with turn(gate, caller):
            order.append(name)
            release[name] = asyncio.Event()
            await release[name].wait()

    tasks = [
        asyncio.ensure_future(read(caller, name))
        for caller, name in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1")]
    ]
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["a1", "b1"]  # a2 waits for a1 (a's bound); c1 for the total
    assert gate.reading == 2 and gate.waiting == 3
    release["a1"].set()
    for _ in range(5):
        await asyncio.sleep(0)
    # c waited for a free turn before a could take one again: c first.
    assert order == ["a1", "b1", "c1"]
    release["b1"].set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["a1", "b1", "c1", "a2"]
    tasks[2].cancel()  # a3 gives up while waiting: nothing is held for it
    for name in ("a2", "c1"):
        release[name].set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert gate.reading == 0 and gate.waiting == 0
    assert order == ["a1", "b1", "c1", "a2"]


async def test_a_turn_handed_over_as_its_waiter_is_cancelled_goes_back() -> None:
    gate = ReadGate(total=1, per_caller=1)
    async with turn(gate, "a"):
        waiter = asyncio.ensure_future(gate.wait("b"))
        await asyncio.sleep(0)
    # The turn was handed to b as a's read ended; b is cancelled before it runs.
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.reading == 0
    async with turn(gate, "c"):
        assert gate.reading == 1


@pytest.mark.parametrize(
    ("hex_address", "ip"),
    [
        ("0100007F", "127.0.0.1"),
        ("0200007F", "127.0.0.2"),
        ("0000000000000000FFFF00000100007F", "127.0.0.1"),  # IPv4-mapped IPv6
        ("00000000000000000000000001000000", "::1"),
    ],
)
def test_proc_addresses_read_as_ips(hex_address: str, ip: str) -> None:
    assert peer_ip(hex_address) == ip
