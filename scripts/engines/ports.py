"""The ports a real worker listens on: free on 127.0.0.1 now, below the kernel's ephemeral
range and never handed out twice by this process, since a worker binds them only after a
start of many seconds (the vLLM worker, worker.py, and the SGLang one, sglang_worker.py)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

FIRST_PORT = 20_000  # above Mooncake's own listening ports (12001, 15000-17000 seen)
_handed_out: set[int] = set()


def ephemeral_floor() -> int:
    """The lowest port the kernel hands out on its own (a connection's local port, a bind
    to port 0): /proc/sys/net/ipv4/ip_local_port_range, else Linux's default."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(neighbours: int = 0) -> int:
    """A port free on 127.0.0.1 now, with the `neighbours` ports after it, below the
    kernel's ephemeral range and not handed out before by this process: a worker binds
    it only after a start of many seconds, and one the kernel chose (port 0) could be
    taken meanwhile by any connection or by UCX or ZMQ binding port 0 (a vLLM worker
    failed to start so: `Failed to bind to address 127.0.0.1:40039`)."""
    top = ephemeral_floor() - 1 - neighbours
    for _ in range(1024):
        port = random.randint(FIRST_PORT, top)
        wanted = range(port, port + neighbours + 1)
        if _handed_out.intersection(wanted):
            continue
        with contextlib.ExitStack() as held:
            try:
                for each in wanted:
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", each))
            except OSError:
                continue
        _handed_out.update(wanted)
        return port
    raise RuntimeError(f"no free port between {FIRST_PORT} and {top} on 127.0.0.1")
