"""API keys reloaded and failures throttled (gateway.security.auth): the keys file read again
when it changes (a broken or removed file keeps the previous keys), the failure table's
window, limit and bounds, and refused calls counted, logged with their peer and then
blocked. Pure tests with fake contexts."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from gateway.config import AuthConfig, ConfigError, build_config
from gateway.security.auth import BLOCKED, MISSING, REJECTED, REJECTED_KEY, THROTTLED, ApiKeyAuth
from gateway.security.blocking import FailureTable, peer_address
from gateway.security.identity import Identities
from gateway.security.keys import ApiKeys, KeyFile
from tests.support import api_keys
from tests.support.api_keys import ALICE, BOB, Context, auth_of, refused, write_keys
from tests.support.waits import until

keys_path = api_keys.keys_path  # the fixture (tests/support/api_keys.py)


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
