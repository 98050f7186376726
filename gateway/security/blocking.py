"""Failure blocking: failed authentications counted per peer address, an address that
fails too often refused for a while, and which failures get a log line."""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import unquote

MAX_PEERS = 10_000  # peer addresses the failure table remembers (~200 B each)
LOG_EVERY_S = 10.0  # one failure line per peer address per this long ...
MAX_LINES = 20  # ... and at most this many lines over all peers; a summary for the rest


def peer_address(peer: str) -> str:
    """The address a client's failures are counted against, from `context.peer()`
    (`ipv4:1.2.3.4:5678`, `ipv6:[::1]:5678`, possibly %-encoded): its IP, an IPv6
    address's /64 (one host usually holds a whole /64), else the peer string."""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]").partition("%")[0]
        try:
            ip = ipaddress.IPv6Address(host)
        except ValueError:
            return host
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return peer


@dataclass(slots=True)
class _Peer:
    failures: int = 0
    window_start: float = 0.0
    blocked_until: float = -math.inf
    logged_at: float = -math.inf
    summary: int = -1  # the summary period this peer's unlogged failures were counted in


class FailureTable:
    """Failed authentications per peer address, bounded in memory.

    `limit` failures within `window_s` (a window opens at a peer's first failure) block
    the address for `block_s` (limit 0: never). Nothing resets a count but its window's
    end: not a success, of that peer or another (an attacker holding one key could
    otherwise guess others between successes). At most `max_peers` addresses are held;
    the one whose last failure (or refused attempt) is oldest goes first.

    Also decides which failures get a log line: one per address per `log_every_s`, at
    most `max_lines` over all addresses in such a period; the others are summed for
    `summary()`."""

    def __init__(
        self,
        limit: int,
        window_s: float,
        block_s: float,
        max_peers: int = MAX_PEERS,
        log_every_s: float = LOG_EVERY_S,
        max_lines: int = MAX_LINES,
    ) -> None:
        self.limit, self.window_s, self.block_s = limit, window_s, block_s
        self._max_peers, self._every_s, self._max_lines = max_peers, log_every_s, max_lines
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._blocking_until = -math.inf  # no address is blocked after this
        self._period_start = -math.inf
        self._period = 0
        self._lines = 0
        self._unlogged = 0
        self._unlogged_peers = 0

    def __len__(self) -> int:
        return len(self._peers)

    def active(self, now: float) -> bool:
        """Some address may be blocked (then calls are checked where the peer is known)."""
        return now < self._blocking_until

    def blocked(self, address: str, now: float) -> bool:
        if now >= self._blocking_until:
            return False
        peer = self._peers.get(address)
        if peer is None or now >= peer.blocked_until:
            return False
        self._peers.move_to_end(address)  # it keeps trying: keep its entry
        return True

    def fail(self, address: str, now: float) -> bool:
        """Count one failure; True if it blocks the address (from now)."""
        peer = self._peers.get(address)
        if peer is None:
            if len(self._peers) >= self._max_peers:
                self._peers.popitem(last=False)
            peer = self._peers[address] = _Peer(window_start=now)
        else:
            self._peers.move_to_end(address)
            if now - peer.window_start >= self.window_s:
                peer.failures, peer.window_start = 0, now
        peer.failures += 1
        if not self.limit or peer.failures < self.limit:
            return False
        peer.failures, peer.window_start = 0, now
        peer.blocked_until = now + self.block_s
        self._blocking_until = max(self._blocking_until, peer.blocked_until)
        return True

    def loggable(self, address: str, now: float, must: bool = False) -> bool:
        """Whether this failure of `address` gets its own log line (`must`: if the
        overall budget allows); if not, it goes into the summary."""
        if now - self._period_start >= self._every_s:
            self._period_start, self._lines = now, 0
        peer = self._peers.get(address)
        due = must or peer is None or now - peer.logged_at >= self._every_s
        if due and self._lines < self._max_lines:
            self._lines += 1
            if peer is not None:
                peer.logged_at = now
            return True
        self._unlogged += 1
        if peer is None or peer.summary != self._period:
            self._unlogged_peers += 1
            if peer is not None:
                peer.summary = self._period
        return False

    def summary(self) -> tuple[int, int]:
        """(failures, addresses) left unlogged since the last summary; resets them."""
        counts = self._unlogged, self._unlogged_peers
        self._unlogged = self._unlogged_peers = 0
        self._period += 1
        return counts
