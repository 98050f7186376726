"""A real store for the shared-state tests and benchmarks: redis-server (Debian's
`redis-server`; Valkey's server takes the same options) on a loopback port, in memory
only (no RDB, no AOF), started and stopped as a process. `stop` then `start` brings it
back empty on the same port, as a restarted store would be."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from gateway_sim.client import WAIT_S, free_port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """`with RedisServer() as server:`; `server.url` is what `state.url` takes."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise RuntimeError("no redis-server (apt install redis-server) or valkey-server")
        self.binary = binary
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + WAIT_S
        while not _ping(self.port):
            if self.process.poll() is not None:
                error = self.process.stderr.read() if self.process.stderr else b""
                raise RuntimeError(f"redis-server exited: {error.decode(errors='replace')}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("redis-server did not answer PING")
            time.sleep(0.02)

    def stop(self) -> None:
        """Killed outright (SIGKILL): what a store that crashes looks like to clients."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            if self.process.stderr is not None:
                self.process.stderr.close()
            self.process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
