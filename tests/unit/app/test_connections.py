"""The connection watch's census on real loopback sockets of this process: counting, and
closing a peer's newest connections (by the census that first saw them) past its cap."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app.connections import ConnectionWatch, census, peer_ip

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc")


class Pairs:
    """A listener and the (client, accepted) socket pairs made to it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []

    def connect(self, n: int) -> None:
        for _ in range(n):
            client = socket.create_connection(("127.0.0.1", self.port))
            accepted, _ = self.listener.accept()
            self.pairs.append((client, accepted))

    def shut(self) -> list[bool]:
        """Per pair, in connection order: did the gateway side shut it down?"""
        states = []
        for client, _ in self.pairs:
            client.setblocking(False)
            try:
                states.append(client.recv(1) == b"")
            except BlockingIOError:
                states.append(False)
        return states

    def close(self) -> None:
        for client, accepted in self.pairs:
            client.close()
            accepted.close()
        self.listener.close()


@pytest.fixture
def pairs() -> Iterator[Pairs]:
    made = Pairs()
    yield made
    made.close()


def test_census_counts_the_accepted_side_only(pairs: Pairs) -> None:
    pairs.connect(3)
    seen = census((pairs.port,), per_peer=10, first_seen={})
    assert seen.total == 3 and seen.over == {} and len(seen.seen) == 3
    assert pairs.shut() == [False, False, False]


def test_the_connections_first_seen_stay_and_the_newer_ones_past_the_cap_close(
    pairs: Pairs,
) -> None:
    watch = ConnectionWatch((pairs.port,), cap=100, per_peer=3)
    pairs.connect(3)
    watch.observe(census((pairs.port,), 3, watch.first_seen))
    pairs.connect(4)
    seen = census((pairs.port,), 3, watch.first_seen)
    watch.observe(seen)
    assert seen.total == 7 and seen.over == {"127.0.0.1": 4}
    assert pairs.shut() == [False] * 3 + [True] * 4
    assert watch.over_peers == {"127.0.0.1"}


def test_a_peer_back_under_its_cap_is_logged_again_next_time(pairs: Pairs) -> None:
    reports: list[tuple[int, int]] = []
    watch = ConnectionWatch((pairs.port,), cap=100, per_peer=1, report=lambda *r: reports.append(r))
    pairs.connect(2)
    watch.observe(census((pairs.port,), 1, watch.first_seen))
    assert watch.over_peers == {"127.0.0.1"}
    watch.observe(census((pairs.port,), 1, watch.first_seen))  # the closed one is gone
    assert watch.over_peers == set()
    assert reports[0] == (2, 1) and reports[1][1] == 0


def test_peer_ip_reads_procs_hex() -> None:
    assert peer_ip("0100007F") == "127.0.0.1"
    assert peer_ip("0000000000000000FFFF00000200007F") == "127.0.0.2"


def test_a_line_read_twice_is_one_connection(pairs: Pairs, monkeypatch: Any) -> None:
    """/proc/net/tcp is read in pieces while it changes: a line may come twice."""
    pairs.connect(2)
    real = Path.read_text

    def doubled(self: Path, *args: Any, **kwargs: Any) -> str:
        text = real(self, *args, **kwargs)
        if self.name in ("tcp", "tcp6"):
            header, *lines = text.splitlines()
            return "\n".join([header, *lines, *lines])
        return text

    monkeypatch.setattr(Path, "read_text", doubled)
    seen = census((pairs.port,), per_peer=10, first_seen={})
    assert seen.total == 2 and len(seen.seen) == 2


def test_a_peers_connections_to_both_ports_count_together(pairs: Pairs) -> None:
    """The main port and the picker's: one peer's share covers both."""
    other = Pairs()
    try:
        pairs.connect(2)
        other.connect(2)
        watch = ConnectionWatch((pairs.port, other.port), cap=100, per_peer=3)
        seen = census(watch.ports, 3, watch.first_seen)
        assert seen.total == 4 and seen.over == {"127.0.0.1": 1}
        assert pairs.shut() + other.shut() == [False, False, False, True]
    finally:
        other.close()
