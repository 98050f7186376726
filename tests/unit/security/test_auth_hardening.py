"""API keys reloaded and failures throttled (gateway.security.auth), health exposure and Watch
bounds (gateway.services.health), control characters escaped in logs (gateway.observability.logs).

Pure tests with fake contexts, and one in-process grpc server for the handler shapes the
auth interceptor hands grpc (refusing without reading, checking in the handler)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from gateway.config import AuthConfig, ConfigError, build_config
from gateway.observability.logs import escape, escape_controls
from gateway.security.auth import (
    BLOCKED,
    MISSING,
    MISSING_KEY,
    REJECTED,
    REJECTED_KEY,
    THROTTLED,
    ApiKeyAuth,
)
from gateway.security.blocking import FailureTable, peer_address
from gateway.security.identity import Identities
from gateway.security.keys import ApiKeys, KeyFile
from gateway.services.health import (
    MAX_SERVICE_NAME,
    NOT_SERVING,
    SERVICE_UNKNOWN,
    SERVING,
    WATCH_BACKLOG,
    HealthService,
)
from tests.support.waits import until

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    """What the code under test asks of an aio.ServicerContext."""

    def __init__(self, key: str | None = None, peer: str = "ipv4:10.0.0.1:5555") -> None:
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def write_keys(path: Path, **keys: str) -> None:
    """Write the file and move its mtime on, so a change is seen whatever the clock tick."""
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text("".join(f"{name}:{key}\n" for name, key in keys.items()))
    os.utime(path, ns=(old + 10**9, old + 10**9))


@pytest.fixture
def keys_path(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    write_keys(path, alice=ALICE, bob=BOB)
    return path


# -- the keys file, reloaded -----------------------------------------------------------


def test_a_changed_file_is_read_again_and_swapped_whole(keys_path: Path) -> None:
    keys = KeyFile(str(keys_path))
    caller = Identities(keys)
    assert keys.name_of(BOB) == "bob" and caller.principal(Context(BOB)) == "key:bob"
    before = keys.keys
    write_keys(keys_path, alice=ALICE)
    with capture_logs() as logs:
        keys.poll()
    assert keys.keys is not before  # one new object: no call sees a half-read file
    assert keys.name_of(BOB) is None and caller.principal(Context(BOB)) is None
    assert keys.name_of(ALICE) == "alice"
    assert [(e["event"], e["removed"], e["keys"]) for e in logs] == [
        ("api keys reloaded", ["bob"], 1)
    ]


def test_an_unchanged_file_is_not_logged_again(keys_path: Path) -> None:
    keys = KeyFile(str(keys_path))
    with capture_logs() as logs:
        for _ in range(3):
            keys.poll()  # maybe read again (changed lately), but the same keys: no line
    assert logs == []


@pytest.mark.parametrize(
    "broken", ["", "# only a comment\n", "alice\n", "alice:short\n", b"\xff\xfe"]
)
def test_a_broken_file_keeps_the_previous_keys_with_one_line(
    keys_path: Path, broken: str | bytes
) -> None:
    keys = KeyFile(str(keys_path))
    old = keys_path.stat().st_mtime_ns
    if isinstance(broken, bytes):
        keys_path.write_bytes(broken)
    else:
        keys_path.write_text(broken)
    os.utime(keys_path, ns=(old + 10**9, old + 10**9))
    with capture_logs() as logs:
        for _ in range(4):
            keys.poll()
    assert keys.name_of(ALICE) == "alice" and keys.name_of(BOB) == "bob"
    assert [e["event"] for e in logs] == ["api keys not reloaded: keeping the previous keys"]
    assert logs[0]["keys"] == 2 and "auth.api_keys_file" in logs[0]["error"]
    # SIGHUP asks explicitly: it is told again.
    with capture_logs() as logs:
        assert keys.reload() is False
    assert len(logs) == 1
    # Fixed: read at the next poll.
    write_keys(keys_path, carol="carol-key-0123456789")
    keys.poll()
    assert keys.name_of("carol-key-0123456789") == "carol" and keys.name_of(ALICE) is None


def test_a_removed_file_keeps_the_keys_and_a_new_one_is_read(keys_path: Path) -> None:
    keys = KeyFile(str(keys_path))
    keys_path.unlink()
    with capture_logs() as logs:
        keys.poll()
        keys.poll()
    assert keys.name_of(ALICE) == "alice" and len(logs) == 1
    assert "No such file" in logs[0]["error"]
    replacement = keys_path.with_name("keys.new")
    write_keys(replacement, bob=BOB)
    replacement.rename(keys_path)  # an atomic replace: a new inode
    keys.poll()
    assert keys.name_of(ALICE) is None and keys.name_of(BOB) == "bob"


def test_reload_reads_at_once_even_with_the_same_stat(keys_path: Path) -> None:
    keys = KeyFile(str(keys_path))
    stat = keys_path.stat()
    keys_path.write_text(f"alice:{ALICE}\nzed:{BOB}\n")  # the same size
    os.utime(keys_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert keys.reload() is True
    assert keys.name_of(BOB) == "zed"


def test_a_huge_keys_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"alice:{ALICE}\n" + "#" * (1 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        ApiKeys.load(str(path))


async def test_the_poll_task_applies_a_change_and_stops(keys_path: Path) -> None:
    auth = ApiKeyAuth(KeyFile(str(keys_path)), poll_s=0.05)
    auth.start()
    try:
        write_keys(keys_path, alice=ALICE)
        for _ in range(100):  # bounded: 5 s
            if auth.name_of(BOB) is None:
                break
            await asyncio.sleep(0.05)
        assert auth.name_of(BOB) is None and auth.name_of(ALICE) == "alice"
    finally:
        await auth.stop()
    assert not auth._tasks


def test_auth_settings_are_checked() -> None:
    config = build_config({"auth": {"failure_limit": 5, "failure_window_s": 2, "block_s": 7}})
    assert config.auth == AuthConfig(None, 5, 2.0, 7.0)
    with pytest.raises(ConfigError, match=r"auth\.failure_window_s and auth\.block_s"):
        build_config({"auth": {"block_s": 0}})
    assert build_config({"auth": {"failure_limit": 0, "block_s": 0}}).auth.failure_limit == 0


# -- the failure table -----------------------------------------------------------------


def test_a_peer_is_blocked_after_the_limit_within_the_window() -> None:
    table = FailureTable(limit=3, window_s=10, block_s=30)
    assert [table.fail("a", t) for t in (0, 1, 2)] == [False, False, True]
    assert table.active(2) and table.blocked("a", 2) and table.blocked("a", 31.9)
    assert not table.blocked("b", 5)  # only that address
    assert not table.blocked("a", 32) and not table.active(32)


def test_failures_spread_wider_than_the_window_never_block() -> None:
    table = FailureTable(limit=3, window_s=10, block_s=30)
    assert not any(table.fail("a", t) for t in (0, 6, 12, 18, 24, 30, 36))
    assert not table.active(36)


def test_other_peers_failures_and_successes_do_not_reset_a_count() -> None:
    table = FailureTable(limit=3, window_s=10, block_s=30)
    table.fail("a", 0)
    table.fail("a", 1)
    table.fail("b", 1)  # nothing a peer does (there is no "success" to report) resets a's
    assert table.fail("a", 2) is True


def test_limit_zero_never_blocks() -> None:
    table = FailureTable(limit=0, window_s=10, block_s=30)
    assert not any(table.fail("a", 0) for _ in range(1000))
    assert not table.active(0)


def test_the_table_holds_at_most_max_peers_and_evicts_the_oldest() -> None:
    table = FailureTable(limit=2, window_s=10, block_s=30, max_peers=3)
    table.fail("blocked", 0)
    table.fail("blocked", 0)
    for i in range(2):
        table.fail(f"p{i}", 1)
    assert table.blocked("blocked", 2)  # refused again: its entry is kept fresh
    table.fail("p2", 3)  # evicts p0, the least recent
    assert len(table) == 3 and table.blocked("blocked", 3)
    table.fail("p0", 4)  # p0 starts over (p1 evicted)
    assert table.fail("p0", 4) is True


def test_log_lines_are_one_per_peer_per_period_and_capped_overall() -> None:
    table = FailureTable(limit=0, window_s=10, block_s=30, log_every_s=10, max_lines=3)
    logged = []
    for t in range(5):
        for peer in ("a", "b", "c", "d"):
            table.fail(peer, t)
            logged.append((peer, table.loggable(peer, t)))
    assert [p for p, line in logged if line] == ["a", "b", "c"]  # d: over the overall cap
    assert table.summary() == (17, 4)
    assert table.summary() == (0, 0)
    table.fail("a", 11)
    assert table.loggable("a", 11) is True  # a new period


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:127.0.0.1:5555", "127.0.0.1"),
        ("ipv6:[::1]:5555", "::/64"),
        ("ipv6:%5B2001:db8::7%5D:443", "2001:db8::/64"),
        ("ipv6:[2001:db8:0:0:ffff::1]:1", "2001:db8::/64"),
        ("ipv6:[::ffff:10.1.2.3]:9", "10.1.2.3"),
        ("unix:/tmp/sock", "unix:/tmp/sock"),
    ],
)
def test_failures_count_against_the_ip_or_its_ipv6_64(peer: str, address: str) -> None:
    assert peer_address(peer) == address


# -- refusing, counting and logging ----------------------------------------------------


def auth_of(path: Path, limit: int = 3) -> tuple[ApiKeyAuth, list[str], list[float]]:
    counted: list[str] = []
    now = [100.0]
    config = AuthConfig(str(path), failure_limit=limit, failure_window_s=10, block_s=30)
    auth = ApiKeyAuth(KeyFile(str(path)), config, count=counted.append, clock=lambda: now[0])
    return auth, counted, now


async def refused(coro: Any) -> Aborted:
    with pytest.raises(Aborted) as caught:
        await coro
    return caught.value


async def test_failures_are_counted_logged_with_the_peer_and_then_blocked(
    keys_path: Path,
) -> None:
    auth, counted, now = auth_of(keys_path)
    with capture_logs() as logs:
        for key in (None, "wrong-key-0123456789"):
            error = await refused(auth.require(Context(key), "/m"))
            assert error.code is grpc.StatusCode.UNAUTHENTICATED
        assert error.details == REJECTED_KEY
        error = await refused(auth.require(Context("wrong"), "/m"))  # the third: blocked
        assert error.details == THROTTLED
        # Blocked: even the right key is refused, without being looked at.
        error = await refused(auth.require(Context(ALICE), "/m"))
        assert error.details == THROTTLED
        await auth.require(Context(ALICE, peer="ipv4:10.0.0.2:1"), "/m")  # another address
        now[0] += 30
        await auth.require(Context(ALICE), "/m")  # the block is over
    assert counted == [MISSING, REJECTED, REJECTED, BLOCKED]
    assert [(e["event"], e.get("reason")) for e in logs] == [
        ("authentication failed", MISSING),
        ("peer blocked after failed authentications", REJECTED),
    ]
    assert logs[0]["peer"] == "ipv4:10.0.0.1:5555" and logs[0]["method"] == "/m"
    assert logs[1]["blocked_s"] == 30


async def test_unlogged_failures_are_summed_in_one_line(keys_path: Path) -> None:
    auth, counted, now = auth_of(keys_path, limit=0)
    with capture_logs() as logs:
        for _ in range(50):
            await refused(auth.require(Context("wrong"), "/m"))
        now[0] += 10
        auth.flush(now[0])
    assert len(counted) == 50
    assert [e["event"] for e in logs] == [
        "authentication failed",
        "authentication failures not logged one by one",
    ]
    assert logs[1]["failures"] == 49 and logs[1]["peers"] == 1


async def test_the_interceptor_follows_the_reloaded_keys(keys_path: Path) -> None:
    auth, _, _ = auth_of(keys_path)
    interceptor = auth.interceptor()
    assert interceptor._auth is auth
    write_keys(keys_path, bob=BOB)
    auth.start()
    try:
        auth.reload()
        await until(lambda: auth.name_of(ALICE) is None)
        assert auth.name_of(BOB) == "bob"
    finally:
        await auth.stop()


async def test_a_sighup_storm_costs_one_read_of_the_keys_file_off_the_loop(
    keys_path: Path,
) -> None:
    """A hundred SIGHUPs before the reader wakes: one read, in another thread; one more
    after it is asked for again."""
    auth = ApiKeyAuth(KeyFile(str(keys_path)), poll_s=3600)  # no stat poll meanwhile
    keys = auth.keys
    assert isinstance(keys, KeyFile)
    read_in: list[int] = []
    read = keys._read

    def counted() -> Any:
        read_in.append(threading.get_ident())
        return read()

    keys._read = counted  # type: ignore[method-assign]
    auth.start()
    try:
        for _ in range(100):
            auth.reload()
        await until(lambda: len(read_in) == 1 and not auth._asked.is_set())
        assert read_in[0] != threading.get_ident()  # not on the loop's thread
        auth.reload()
        await until(lambda: len(read_in) == 2)
    finally:
        await auth.stop()


# -- health: exposure and Watch bounds --------------------------------------------------


def health(max_watches: int = 1024, guarded: bool = False) -> tuple[HealthService, list[str]]:
    asked: list[str] = []

    async def guard(context: Any, method: str) -> None:
        asked.append(method)
        if context.invocation_metadata() == ():
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "key")

    service = HealthService(max_watches, guard if guarded else None)
    service.update({"": SERVING, "liveness": SERVING, "readiness": SERVING, "models/m": SERVING})
    return service, asked


def check(name: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=name)


async def test_probe_names_stay_open_and_the_others_need_a_key() -> None:
    service, asked = health(guarded=True)
    for name in ("", "liveness", "readiness"):
        reply = await service.Check(check(name), Context())
        assert reply.status == SERVING
    assert asked == []
    error = await refused(service.Check(check("models/m"), Context()))
    assert error.code is grpc.StatusCode.UNAUTHENTICATED
    error = await refused(service.Check(check("models/nope"), Context()))  # no hint either
    assert error.code is grpc.StatusCode.UNAUTHENTICATED
    assert (await service.Check(check("models/m"), Context(ALICE))).status == SERVING
    error = await refused(anext(service.Watch(check("models/m"), Context())))
    assert error.code is grpc.StatusCode.UNAUTHENTICATED
    assert asked == ["/grpc.health.v1.Health/Check"] * 3 + ["/grpc.health.v1.Health/Watch"]
    watch = service.Watch(check(""), Context())
    assert (await anext(watch)).status == SERVING
    await watch.aclose()


async def test_not_found_repeats_at_most_256_characters() -> None:
    service, _ = health()
    error = await refused(service.Check(check("x" * 10_000), Context()))
    assert error.code is grpc.StatusCode.NOT_FOUND
    assert error.details == f"unknown service {'x' * 256 + '...'!r}"


async def test_a_watch_name_longer_than_any_entry_is_refused() -> None:
    service, _ = health()
    error = await refused(anext(service.Watch(check("x" * (MAX_SERVICE_NAME + 1)), Context())))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    longest = service.Watch(check("models/" + "m" * 256), Context())
    assert (await anext(longest)).status == SERVICE_UNKNOWN
    await longest.aclose()


async def test_watches_over_the_cap_are_refused_and_a_slot_comes_back() -> None:
    service, _ = health(max_watches=2)
    watches = [service.Watch(check(""), Context()) for _ in range(2)]
    for watch in watches:
        assert (await anext(watch)).status == SERVING
    with capture_logs() as logs:
        for _ in range(3):
            error = await refused(anext(service.Watch(check("models/m"), Context())))
            assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details == "too many health watches"
    assert len(logs) == 1  # one line when the cap is hit, not one per refusal
    await watches[0].aclose()
    assert service.watching == 1
    again = service.Watch(check("models/m"), Context())
    assert (await anext(again)).status == SERVING
    for watch in (watches[1], again):
        await watch.aclose()
    assert service.watching == 0 and service._watchers == {}


async def test_a_watcher_that_does_not_read_holds_a_few_statuses() -> None:
    service, _ = health()
    watch = service.Watch(check("models/m"), Context())
    assert (await anext(watch)).status == SERVING
    for i in range(1000):
        service.update({"": SERVING, "models/m": NOT_SERVING if i % 2 == 0 else SERVING})
    (watcher,) = service._watchers["models/m"]
    assert len(watcher.pending) == WATCH_BACKLOG
    service.update({"": SERVING, "models/m": NOT_SERVING})  # the newest is never dropped
    seen = []
    service.close_watches()
    async for reply in watch:
        seen.append(reply.status)
    assert seen[-1] == NOT_SERVING and len(seen) <= WATCH_BACKLOG


async def test_a_watcher_that_reads_sees_every_change_then_the_close() -> None:
    service, _ = health()
    watch = service.Watch(check("models/m"), Context())
    assert (await anext(watch)).status == SERVING
    service.update({"": SERVING, "models/m": NOT_SERVING})
    assert (await anext(watch)).status == NOT_SERVING
    service.update({"": SERVING, "models/m": SERVING})
    service.update({"": SERVING, "models/m": NOT_SERVING})
    service.close_watches()
    assert [r.status async for r in watch] == [SERVING, NOT_SERVING]


# -- logs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain", "plain"),
        ("café ü 模型", "café ü 模型"),
        ("a\x00b", "a\\x00b"),
        ("line\nforged=1", "line\\nforged=1"),
        ("\t\r\x1b[31m\x7f", "\\t\\r\\x1b[31m\\x7f"),
        ("\x85\u2028\u202e", "\\x85\\u2028\\u202e"),
    ],
)
def test_control_characters_are_escaped(raw: str, shown: str) -> None:
    assert escape(raw) == shown


def test_the_processor_escapes_nested_values_and_keeps_clean_ones_as_they_are() -> None:
    clean = ["a", ("b", 1)]
    event = {
        "event": "request",
        "model": "m\x00",
        "ids": ["ok", "x\ny"],
        "meta": {"k": "v\x1b"},
        "n": 3,
        "clean": clean,
    }
    out = escape_controls(None, "info", event)
    assert out["model"] == "m\\x00" and out["ids"] == ["ok", "x\\ny"]
    assert out["meta"] == {"k": "v\\x1b"} and out["n"] == 3 and out["clean"] is clean


@pytest.fixture
def rendered() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_rendered_lines_carry_no_control_characters(
    log_format: str, rendered: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.observability import logs

    logs.configure(log_format, "info")
    structlog.get_logger("t").info("request", model="evil\x00\nforged=1\x1b[2J")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x00" not in err and "\x1b" not in err
    if log_format == "json":
        assert json.loads(err)["model"] == "evil\\x00\\nforged=1\\x1b[2J"
    else:  # quoted with repr() or not, as ConsoleRenderer sees fit: escaped either way
        assert "evil\\x00" in err or "evil\\\\x00" in err


# -- the handlers grpc gets, in process ------------------------------------------------


class Echo:
    """Methods of every shape, counting the request messages they read."""

    def __init__(self) -> None:
        self.reads = 0

    async def unary(self, request: bytes, context: aio.ServicerContext) -> bytes:
        self.reads += 1
        return request

    async def server_stream(self, request: bytes, context: aio.ServicerContext) -> Any:
        self.reads += 1
        for _ in range(2):
            yield request

    async def writer(self, request: bytes, context: aio.ServicerContext) -> None:
        self.reads += 1
        await context.write(request)

    async def client_stream(self, requests: Any, context: aio.ServicerContext) -> bytes:
        parts = []
        async for part in requests:
            self.reads += 1
            parts.append(part)
        return b"".join(parts)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "t.Echo",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
                "Writer": grpc.unary_stream_rpc_method_handler(self.writer),
                "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
            },
        )


@pytest.fixture
async def served(keys_path: Path) -> AsyncIterator[tuple[aio.Channel, ApiKeyAuth, Echo]]:
    auth, _, _ = auth_of(keys_path, limit=2)
    auth.clock = asyncio.get_running_loop().time
    echo = Echo()
    server = aio.server(interceptors=[auth.interceptor()])
    server.add_generic_rpc_handlers((echo.handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(health()[0], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch, auth, echo
    await server.stop(None)


async def call_every_shape(ch: aio.Channel, key: str | None) -> list[Any]:
    md = (("authorization", f"Bearer {key}"),) if key else ()
    results: list[Any] = []
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: ch.unary_unary("/t.Echo/Unary")(b"u", metadata=md),
        lambda: _all(ch.unary_stream("/t.Echo/ServerStream")(b"s", metadata=md)),
        lambda: _all(ch.unary_stream("/t.Echo/Writer")(b"w", metadata=md)),
        lambda: ch.stream_unary("/t.Echo/ClientStream")(iter([b"a", b"b"]), metadata=md),
    ]
    for call in calls:
        try:
            results.append(await call())
        except aio.AioRpcError as error:
            results.append((error.code(), error.details()))
    return results


async def _all(call: Any) -> list[bytes]:
    return [message async for message in call]


async def test_every_shape_is_served_with_a_key_and_refused_unread_without(
    served: tuple[aio.Channel, ApiKeyAuth, Echo],
) -> None:
    ch, auth, echo = served
    assert await call_every_shape(ch, ALICE) == [b"u", [b"s", b"s"], [b"w"], b"ab"]
    assert echo.reads == 5
    unauthenticated = (grpc.StatusCode.UNAUTHENTICATED, REJECTED_KEY)
    assert (
        await call_every_shape(ch, "wrong")
        == [unauthenticated] + [(grpc.StatusCode.UNAUTHENTICATED, THROTTLED)] * 3
    )
    assert echo.reads == 5  # nothing refused was read
    # Blocked: the right key is refused too, checked in the handler before any read.
    assert await call_every_shape(ch, ALICE) == [(grpc.StatusCode.UNAUTHENTICATED, THROTTLED)] * 4
    assert echo.reads == 5 and auth.failures.active(auth.clock())


async def test_while_another_address_is_blocked_every_shape_still_serves(
    served: tuple[aio.Channel, ApiKeyAuth, Echo],
) -> None:
    ch, auth, echo = served
    now = auth.clock()
    auth.failures.fail("10.9.9.9", now)
    assert auth.failures.fail("10.9.9.9", now) is True  # checks move into the handlers
    assert await call_every_shape(ch, ALICE) == [b"u", [b"s", b"s"], [b"w"], b"ab"]
    assert echo.reads == 5
    assert (
        await call_every_shape(ch, None)
        == [(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)]
        + [(grpc.StatusCode.UNAUTHENTICATED, THROTTLED)] * 3
    )
    assert echo.reads == 5
    stub = health_pb2_grpc.HealthStub(ch)
    with pytest.raises(aio.AioRpcError) as caught:
        await stub.List(health_pb2.HealthListRequest())
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.UNAUTHENTICATED,
        THROTTLED,
    )
    assert (await stub.Check(check(""))).status == SERVING  # open, even blocked


async def test_health_list_needs_a_key(served: tuple[aio.Channel, ApiKeyAuth, Echo]) -> None:
    ch, _, _ = served
    stub = health_pb2_grpc.HealthStub(ch)
    with pytest.raises(aio.AioRpcError) as caught:
        await stub.List(health_pb2.HealthListRequest())
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    listed = await stub.List(
        health_pb2.HealthListRequest(), metadata=(("authorization", f"Bearer {ALICE}"),)
    )
    assert set(listed.statuses) == {"", "liveness", "readiness", "models/m"}
