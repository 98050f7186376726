"""The line protocol every simulated side channel speaks (bootstrap rendezvous, vLLM KV
side channel, embedding push): one request line, one answer line, over plain TCP.

A line is ``VERB KEY [PAYLOAD]\\n``: ``VERB`` an upper-case word, ``KEY`` a request id or
room number percent-encoded (so any request id fits in one word), ``PAYLOAD`` the rest of
the line, a JSON object when present. The real engines use ZMQ, NIXL or Mooncake here;
what the simulation keeps is *who must reach whom, with which key*, so that a wrong
address or key fails as it would in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

log = logging.getLogger("gateway_sim")

# Lines carry ids, token ids and digests, never tensors: 1 MiB is plenty and bounded.
MAX_LINE_BYTES = 1 << 20
# An idle peer is dropped after this long, so a stray connection cannot pin a server.
IDLE_TIMEOUT_S = 60.0


def address(host: str, port: int) -> str:
    """``host:port`` for messages, ``[v6]:port`` for an IPv6 host."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProtocolError(Exception):
    """A peer sent something that is not a line of this protocol."""


@dataclass(frozen=True, slots=True)
class Line:
    """One parsed line."""

    verb: str
    key: str
    payload: dict[str, Any]

    def encode(self) -> bytes:
        text = f"{self.verb} {quote(self.key, safe='')}"
        if self.payload:
            text += " " + json.dumps(self.payload, separators=(",", ":"))
        return (text + "\n").encode()

    @classmethod
    def decode(cls, raw: bytes) -> Line:
        """Parse one line (with or without its newline); ProtocolError if malformed."""
        try:
            text = raw.decode().rstrip("\r\n")
        except UnicodeDecodeError:
            raise ProtocolError("line is not UTF-8") from None
        verb, _, rest = text.partition(" ")
        key, _, body = rest.partition(" ")
        if not verb.isalpha() or not verb.isupper() or not key:
            raise ProtocolError(f"not a protocol line: {text[:80]!r}")
        payload: Any = {}
        if body:
            try:
                payload = json.loads(body)
            except ValueError:
                raise ProtocolError(f"payload is not JSON: {body[:80]!r}") from None
            if not isinstance(payload, dict):
                raise ProtocolError("payload is not a JSON object")
        return cls(verb, unquote(key), payload)


Handler = Callable[[Line], Awaitable[Line]]


class LineServer:
    """A TCP server answering each request line with the ``handler``'s line.

    ``close`` also closes the open connections and cancels their handlers: Python 3.11's
    ``Server.close`` leaves accepted connections running, which would keep a stopping
    worker's peers waiting.
    """

    def __init__(self, label: str, host: str, port: int, handler: Handler) -> None:
        self.label = label
        self.host = host
        self.port = port
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen; returns the bound port (``port`` 0 picks a free one)."""
        self._server = await asyncio.start_server(
            self._serve, self.host.strip("[]"), self.port, limit=MAX_LINE_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                async with asyncio.timeout(IDLE_TIMEOUT_S):
                    raw = await reader.readline()
                if not raw.endswith(b"\n"):
                    return  # EOF (or a line cut short): the peer is done
                try:
                    reply = await self._handler(Line.decode(raw))
                except ProtocolError as exc:
                    reply = Line("ERROR", "-", {"message": str(exc)})
                writer.write(reply.encode())
                await writer.drain()
        except (OSError, TimeoutError, ValueError) as exc:  # ValueError: line over limit
            log.debug("%s channel: dropping a connection: %r", self.label, exc)
        except asyncio.CancelledError:
            # Only ``close`` cancels a connection. Ending normally keeps asyncio's stream
            # callback from logging the cancellation as an unhandled error.
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()


async def exchange(host: str, port: int, line: Line, timeout_s: float) -> Line:
    """Connect, send ``line``, return the answer; the whole exchange within ``timeout_s``.

    Raises ConnectionRefusedError/OSError (cannot connect), TimeoutError, or
    ProtocolError (the peer closed or answered garbage).
    """
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host.strip("[]"), port, limit=MAX_LINE_BYTES)
        try:
            writer.write(line.encode())
            await writer.drain()
            raw = await reader.readline()
        except ValueError:
            raise ProtocolError("answer line too long") from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    if not raw.endswith(b"\n"):
        raise ProtocolError("closed the connection")
    return Line.decode(raw)
