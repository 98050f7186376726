"""A KV handoff: the worker that ran the prefill publishes what the decode needs under a
key; the decode connects to it, asks for that key, and waits (bounded) for it.

Both PD flavours are this one exchange (see ``lines`` for the framing)::

    decode  -> prefill   WAIT <key> {"wait_ms": <ms>}
    prefill -> decode    READY <key> {<what the prefill handed over>}
                      or UNKNOWN <key>          (nothing under that key within wait_ms)

The prefill answers as soon as the key is (or becomes) published, waiting at most
``wait_ms`` (capped at the 30 s a handoff lives). A READY hands the value over: it is
taken, so a second decode asking for the same key does not get it, as KV is moved once.
SGLang's rendezvous (``rendezvous``) waits because its two legs run concurrently; vLLM's
side channel (``kv_channel``) asks with ``wait_ms`` 0 because its decode starts only once
its prefill has finished.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway_sim.lines import Line, LineServer, ProtocolError, exchange
from gateway_sim.mailbox import DEFAULT_TTL_S, Mailbox

log = logging.getLogger("gateway_sim")

WAIT = "WAIT"
READY = "READY"
UNKNOWN = "UNKNOWN"


class KvTransferError(Exception):
    """The decode could not get its KV: the message says why, naming key and address."""


class HandoffServer:
    """The prefill side: published values, served on a TCP port."""

    def __init__(self, label: str, host: str, port: int, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._box: Mailbox[dict[str, Any]] = Mailbox(ttl_s)
        self.server = LineServer(label, host, port, self._answer)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def published(self) -> int:
        """Handoffs published and not yet taken (nor expired)."""
        return len(self._box)

    def publish(self, key: str, value: dict[str, Any]) -> None:
        self._box.put(key, value)

    async def _answer(self, line: Line) -> Line:
        if line.verb != WAIT:
            raise ProtocolError(f"unknown verb {line.verb!r}")
        wait_ms = line.payload.get("wait_ms", 0)
        if not isinstance(wait_ms, int | float) or wait_ms < 0:
            raise ProtocolError(f"bad wait_ms {wait_ms!r}")
        if wait_ms:
            await self._box.wait(line.key, min(wait_ms / 1000.0, self._ttl_s))
        value = self._box.take(line.key)
        if value is None:
            log.info("%s %s: not published within %d ms", self.server.label, line.key, wait_ms)
            return Line(UNKNOWN, line.key, {})
        return Line(READY, line.key, value)


async def take(host: str, port: int, key: str, wait_s: float, timeout_s: float) -> dict[str, Any]:
    """The decode side: ask ``host:port`` for ``key``, waiting up to ``wait_s`` for it to
    be published, the whole exchange bounded by ``timeout_s``.

    Raises ConnectionRefusedError/OSError (cannot connect), TimeoutError, ProtocolError
    (closed or garbled), or LookupError (the prefill answered UNKNOWN).
    """
    answer = await exchange(host, port, Line(WAIT, key, {"wait_ms": int(wait_s * 1000)}), timeout_s)
    if answer.verb == UNKNOWN:
        raise LookupError(key)
    if answer.verb != READY or answer.key != key:
        raise ProtocolError(f"unexpected answer {answer.verb} {answer.key}")
    return answer.payload
