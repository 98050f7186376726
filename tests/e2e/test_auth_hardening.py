"""API keys against a real gateway process: the keys file reloaded on change and on
SIGHUP, failed attempts counted in the metric and logged with the peer, a peer throttled
after too many, health names that reveal models behind a key, and an unauthenticated
request refused without being read."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.core.wire import encode_varint
from gateway_sim.client import channel, collect, model_md, sgl, sgl_generate, sgl_grpc, write_config
from gateway_sim.launch import Child, worker_url
from tests.support.launch import Launcher
from tests.support.serial import run_alone
from tests.support.waits import WAIT_S

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789"}
MISSING = "this gateway needs the metadata 'authorization: Bearer <API key>'"
REJECTED = "the API key was not accepted"
THROTTLED = "too many failed attempts, retry later"


def bearer(key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


def write_keys(path: Path, keys: dict[str, str]) -> None:
    """Replace the file the way deployment tools do: a new file renamed over the old."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_text("".join(f"{name}:{key}\n" for name, key in keys.items()))
    fresh.rename(path)


@dataclass
class Keyed:
    gateway: Child
    keys: Path

    @property
    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.gateway.log_path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return lines

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [line for line in self.log_lines if line.get("event") == event]

    def wait_logged(self, event: str, count: int = 1) -> list[dict[str, Any]]:
        deadline = time.monotonic() + WAIT_S
        while len(self.logged(event)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        found = self.logged(event)
        assert len(found) >= count, f"expected {count} {event!r} lines, got {found}"
        return found

    def metric(self, name: str, **labels: str) -> float:
        port = self.gateway.port_of("metrics")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}")
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.rpartition(" ")[2])
        return 0.0

    def rss_peak_kib(self) -> int:
        status = Path(f"/proc/{self.gateway.process.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1])


@pytest.fixture
def start_keyed(sim: Launcher, gateway: Launcher, tmp_path: Path) -> Callable[..., Keyed]:
    def start(**auth: Any) -> Keyed:
        keys = tmp_path / "keys"
        write_keys(keys, KEYS)
        config = write_config(tmp_path, {"auth": {"api_keys_file": str(keys), **auth}})
        worker = sim("--model", "m")
        gw = gateway(
            "--config", config, "--worker", worker_url(worker, model="m", runtime="sglang")
        )
        return Keyed(gw, keys)

    return start


async def health_check(ch: aio.Channel, key: str | None) -> grpc.StatusCode:
    """The engine HealthCheck with `key`: a protected method, answered from memory."""
    stub = sgl_grpc.SglangSchedulerStub(ch)
    extra = (bearer(key),) if key else ()
    try:
        await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=model_md("m", *extra))
    except aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def refusal(ch: aio.Channel, key: str | None) -> tuple[grpc.StatusCode, str]:
    stub = sgl_grpc.SglangSchedulerStub(ch)
    extra = (bearer(key),) if key else ()
    with pytest.raises(aio.AioRpcError) as caught:
        await stub.HealthCheck(sgl.HealthCheckRequest(), metadata=model_md("m", *extra))
    return caught.value.code(), caught.value.details()


async def time_until_status(
    ch: aio.Channel, key: str, want: grpc.StatusCode, within_s: float
) -> float | None:
    """Seconds until a call with `key` is answered `want`, or None within `within_s`."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        if await health_check(ch, key) is want:
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    return None


async def test_a_removed_key_is_refused_within_two_seconds(
    start_keyed: Callable[..., Keyed], strict: bool
) -> None:
    """The file is read every second without a signal: a removed key is refused, an
    added one works, within 2 s in the timing tier (else WAIT_S: a busy machine)."""
    keyed = start_keyed(failure_limit=0)  # polling with a key not yet valid fails often
    within_s = 2.0 if strict else WAIT_S
    run_alone()
    async with channel(keyed.gateway.address) as ch:
        assert await health_check(ch, KEYS["bob"]) is grpc.StatusCode.OK
        write_keys(keyed.keys, {"alice": KEYS["alice"]})
        took = await time_until_status(ch, KEYS["bob"], grpc.StatusCode.UNAUTHENTICATED, within_s)
        assert took is not None, f"bob's key still worked {within_s} s after it left the file"
        assert await health_check(ch, KEYS["alice"]) is grpc.StatusCode.OK
        # A key added to the file works as soon, for the principal too (Abort scoping).
        write_keys(keyed.keys, {"alice": KEYS["alice"], "carol": "carol-key-0123456789"})
        took = await time_until_status(ch, "carol-key-0123456789", grpc.StatusCode.OK, within_s)
        assert took is not None
        stub = sgl_grpc.SglangSchedulerStub(ch)
        call = stub.Generate(
            sgl_generate("c1"), metadata=model_md("m", bearer("carol-key-0123456789"))
        )
        messages, error = await collect(call)
        assert error is None and messages
    reloaded = keyed.wait_logged("api keys reloaded", 2)
    assert reloaded[0]["removed"] == ["bob"] and reloaded[1]["added"] == ["carol"]


async def test_a_broken_file_keeps_the_previous_keys_and_says_so_once(
    start_keyed: Callable[..., Keyed],
) -> None:
    keyed = start_keyed(failure_limit=0)
    async with channel(keyed.gateway.address) as ch:
        keyed.keys.write_text("alice:short\n")  # in place, not renamed: a half-written file
        (line,) = keyed.wait_logged("api keys not reloaded: keeping the previous keys")
        assert "line 1: expected name:key" in line["error"] and line["keys"] == 2
        for name in ("alice", "bob"):
            assert await health_check(ch, KEYS[name]) is grpc.StatusCode.OK
        keyed.keys.write_text("")  # emptied: the same
        keyed.wait_logged("api keys not reloaded: keeping the previous keys", 2)
        assert await health_check(ch, KEYS["bob"]) is grpc.StatusCode.OK
        # SIGHUP reads the file at once; fixed, it takes effect.
        write_keys(keyed.keys, {"bob": KEYS["bob"]})
        keyed.gateway.process.send_signal(signal.SIGHUP)
        took = await time_until_status(
            ch, KEYS["alice"], grpc.StatusCode.UNAUTHENTICATED, within_s=WAIT_S
        )
        assert took is not None
        assert await health_check(ch, KEYS["bob"]) is grpc.StatusCode.OK
        # SIGHUP with nothing changed: read, said, and the process keeps serving.
        keyed.gateway.process.send_signal(signal.SIGHUP)
        keyed.wait_logged("reloaded")
        unchanged = [e for e in keyed.wait_logged("api keys reloaded") if e.get("unchanged")]
        deadline = time.monotonic() + WAIT_S
        while not unchanged and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            unchanged = [e for e in keyed.logged("api keys reloaded") if e.get("unchanged")]
        assert unchanged and keyed.gateway.process.poll() is None
        assert await health_check(ch, KEYS["bob"]) is grpc.StatusCode.OK
    # Two broken versions, two lines: not one a poll.
    assert len(keyed.logged("api keys not reloaded: keeping the previous keys")) == 2


async def test_failed_attempts_are_counted_and_logged_with_the_peer(
    start_keyed: Callable[..., Keyed],
) -> None:
    keyed = start_keyed(failure_limit=1000)
    assert keyed.metric("gateway_auth_failures_total", reason="rejected") == 0.0  # shown at 0
    async with channel(keyed.gateway.address) as ch:
        for _ in range(3):
            assert await refusal(ch, "wrong-key-0123456789") == (
                grpc.StatusCode.UNAUTHENTICATED,
                REJECTED,
            )
        for _ in range(2):
            assert await refusal(ch, None) == (grpc.StatusCode.UNAUTHENTICATED, MISSING)
        assert await health_check(ch, KEYS["alice"]) is grpc.StatusCode.OK
    assert keyed.metric("gateway_auth_failures_total", reason="rejected") == 3.0
    assert keyed.metric("gateway_auth_failures_total", reason="missing") == 2.0
    assert keyed.metric("gateway_auth_failures_total", reason="throttled") == 0.0
    # One line for the peer in the period, not one per attempt; the key never logged.
    (line,) = keyed.wait_logged("authentication failed")
    assert line["peer"].startswith("ipv4:127.0.0.1:") and line["reason"] == "rejected"
    assert line["method"] == "/sglang.grpc.scheduler.SglangScheduler/HealthCheck"
    assert "wrong-key" not in keyed.gateway.log_path.read_text()


async def test_a_peer_past_the_failure_limit_is_refused_for_a_while(
    start_keyed: Callable[..., Keyed],
) -> None:
    keyed = start_keyed(failure_limit=5, failure_window_s=10, block_s=2)
    async with channel(keyed.gateway.address) as ch:
        answers = [await refusal(ch, f"guess-{i:02d}-0123456789") for i in range(4)]
        blocked_at = time.monotonic()  # before the fifth failure, which blocks the peer
        answers.append(await refusal(ch, "guess-04-0123456789"))
        assert [details for _, details in answers] == [REJECTED] * 4 + [THROTTLED]
        # Blocked: the right key is refused too (a guesser learns nothing meanwhile).
        assert await refusal(ch, KEYS["alice"]) == (grpc.StatusCode.UNAUTHENTICATED, THROTTLED)
        assert await refusal(ch, None) == (grpc.StatusCode.UNAUTHENTICATED, THROTTLED)
        # Probes stay open.
        health = health_pb2_grpc.HealthStub(ch)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        took = await time_until_status(ch, KEYS["alice"], grpc.StatusCode.OK, within_s=WAIT_S)
        assert took is not None
        # Blocked at the fifth failure's arrival (after blocked_at) for 2 s by the
        # gateway's monotonic clock, which is this one: not a moment less.
        assert 2.0 <= time.monotonic() - blocked_at <= 2 + WAIT_S
    assert keyed.metric("gateway_auth_failures_total", reason="rejected") == 5.0
    assert keyed.metric("gateway_auth_failures_total", reason="throttled") >= 2.0
    (line,) = keyed.wait_logged("peer blocked after failed authentications")
    assert line["peer"].startswith("ipv4:127.0.0.1:") and line["blocked_s"] == 2


async def test_health_names_that_tell_models_need_a_key_and_probes_do_not(
    start_keyed: Callable[..., Keyed],
) -> None:
    keyed = start_keyed()
    async with channel(keyed.gateway.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        key = (bearer(KEYS["alice"]),)

        async def code(call: Any) -> grpc.StatusCode:
            try:
                await call
            except aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        async def watch_code(name: str, metadata: Any = ()) -> grpc.StatusCode:
            stream = health.Watch(health_pb2.HealthCheckRequest(service=name), metadata=metadata)
            try:
                await stream.read()
            except aio.AioRpcError as error:
                return error.code()
            finally:
                stream.cancel()
            return grpc.StatusCode.OK

        request = health_pb2.HealthCheckRequest
        unauthenticated = grpc.StatusCode.UNAUTHENTICATED
        assert await code(health.List(health_pb2.HealthListRequest())) is unauthenticated
        listed = await health.List(health_pb2.HealthListRequest(), metadata=key)
        assert "models/m" in listed.statuses
        for name in ("", "liveness", "readiness"):
            assert await code(health.Check(request(service=name))) is grpc.StatusCode.OK
            assert await watch_code(name) is grpc.StatusCode.OK
        for name in ("models/m", "models/unknown", "sglang.grpc.scheduler.SglangScheduler"):
            assert await code(health.Check(request(service=name))) is unauthenticated
            assert await watch_code(name) is unauthenticated
        assert await code(health.Check(request(service="models/m"), metadata=key)) in (
            grpc.StatusCode.OK,
        )
        assert await watch_code("models/m", key) is grpc.StatusCode.OK
        # A name longer than any entry cannot park a Watch; NOT_FOUND repeats a bounded name.
        assert await watch_code("x" * 2048, key) is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(aio.AioRpcError) as caught:
            await health.Check(request(service="y" * 5000), metadata=key)
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        assert len(caught.value.details()) < 300


async def test_an_unauthenticated_30_mib_request_is_refused_unread(
    start_keyed: Callable[..., Keyed], strict: bool
) -> None:
    """Eight 30 MiB requests at once without a key, to the front (Generate) and to a
    unary method the interceptor guards (health List): all refused, and the gateway's
    peak RSS grows by far less than one of them (read, they would add 240 MiB)."""
    keyed = start_keyed(failure_limit=0)  # no throttle: each is refused as unauthenticated
    async with channel(keyed.gateway.address) as ch:
        assert await health_check(ch, KEYS["alice"]) is grpc.StatusCode.OK
        before = keyed.rss_peak_kib()
        big = sgl_generate("big")
        big.tokenized.original_text = "x" * (30 << 20)
        # field 15, length-delimited: an unknown field the gateway would have to read
        raw_list = b"\x7a" + encode_varint(30 << 20) + b"\0" * (30 << 20)
        stub = sgl_grpc.SglangSchedulerStub(ch)
        list_call = ch.unary_unary("/grpc.health.v1.Health/List")

        async def generate() -> tuple[grpc.StatusCode, str]:
            _, error = await collect(stub.Generate(big, metadata=model_md("m")))
            assert error is not None
            return error.code(), error.details()

        async def listed() -> tuple[grpc.StatusCode, str]:
            try:
                await list_call(raw_list)
            except aio.AioRpcError as error:
                return error.code(), error.details()
            raise AssertionError("health List without a key was answered")

        started = time.monotonic()
        answers = await asyncio.gather(
            *[generate() for _ in range(4)], *[listed() for _ in range(4)]
        )
        took = time.monotonic() - started
        assert answers == [(grpc.StatusCode.UNAUTHENTICATED, MISSING)] * 8
        grew_mib = (keyed.rss_peak_kib() - before) / 1024
        assert grew_mib < 24, f"the gateway's peak RSS grew {grew_mib:.0f} MiB"
        if strict:  # refused at once (unread: the RSS bound above proves it on any machine)
            assert took < 5.0
        assert await health_check(ch, KEYS["alice"]) is grpc.StatusCode.OK
