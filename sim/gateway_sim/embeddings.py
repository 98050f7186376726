"""EPD embeddings: encoders push the embeddings of a request's multimodal items to the
prefill, which starts that request only once every part has arrived.

The router splits a request's items over ``num_parts`` encoders; each gets
``SglangEncoder/Encode{req_id, part_idx, num_parts, prefill_host, embedding_port}`` and
pushes its part to ``prefill_host:embedding_port[0]``. The prefill's Generate for
``request_id == req_id`` waits (bounded) until it has all ``num_parts`` parts; a part sent
to the wrong prefill, under the wrong id, or never sent makes it fail.

Protocol (TCP on the prefill's ``--embedding-port``; framing in ``lines``)::

    encoder -> prefill   PUSH <req_id> {"part_idx": i, "num_parts": n,
                                        "items": [<digest of each item>], "encoder": <name>}
    prefill -> encoder   OK <req_id> {"parts": <parts received so far>}
                      or ERROR <req_id> {"message": ...}   (e.g. num_parts disagrees)

Items travel as digests: the simulation needs their count, not image bytes. Parts
nobody waits for expire after 30 s.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from gateway_sim.lines import Line, LineServer, ProtocolError, exchange
from gateway_sim.mailbox import Mailbox

log = logging.getLogger("gateway_sim")

LABEL = "embedding"
PUSH = "PUSH"
OK = "OK"
ERROR = "ERROR"


def digest(item: str) -> str:
    return hashlib.sha256(item.encode()).hexdigest()[:16]


class EmbeddingsMissing(Exception):
    """The prefill did not get every part in time; the message says how many it got."""


class PushFailed(Exception):
    """The encoder could not deliver; ``unreachable`` when the prefill was not there."""

    def __init__(self, message: str, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(slots=True)
class Parts:
    """The parts of one request received so far."""

    num_parts: int
    items: dict[int, list[str]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.items) >= self.num_parts

    @property
    def item_count(self) -> int:
        return sum(len(items) for items in self.items.values())


class EmbeddingReceiver:
    """The prefill side: parts by request id, received on the embedding port."""

    def __init__(self, host: str, port: int) -> None:
        self._box: Mailbox[Parts] = Mailbox()
        self.server = LineServer(LABEL, host, port, self._answer)

    @property
    def waiting(self) -> int:
        """Generate calls waiting for their embeddings."""
        return self._box.waiting

    async def wait_all(self, request_id: str, timeout_s: float) -> Parts:
        """All parts of ``request_id`` (taken), or EmbeddingsMissing after ``timeout_s``."""
        parts = await self._box.wait(request_id, timeout_s, lambda parts: parts.complete)
        if parts is None or not parts.complete:
            got = 0 if parts is None else len(parts.items)
            of = "?" if parts is None else str(parts.num_parts)
            raise EmbeddingsMissing(
                f"embeddings for request {request_id}: got {got} of {of} parts "
                f"within {timeout_s:.1f} s"
            )
        self._box.take(request_id)
        return parts

    async def _answer(self, line: Line) -> Line:
        if line.verb != PUSH:
            raise ProtocolError(f"unknown verb {line.verb!r}")
        part_idx = line.payload.get("part_idx")
        num_parts = line.payload.get("num_parts")
        items = line.payload.get("items")
        if (
            not isinstance(part_idx, int)
            or not isinstance(num_parts, int)
            or not 0 <= part_idx < num_parts
            or not isinstance(items, list)
            or not all(isinstance(item, str) for item in items)
        ):
            raise ProtocolError(f"bad PUSH payload for {line.key}")
        parts = self._box.peek(line.key) or Parts(num_parts)
        if parts.num_parts != num_parts:
            message = f"num_parts {num_parts} disagrees with {parts.num_parts} already received"
            return Line(ERROR, line.key, {"message": message})
        parts.items[part_idx] = items
        self._box.put(line.key, parts)  # re-put: wakes the waiting Generate
        log.info(
            "embeddings for %s: part %d/%d (%d items) from %s",
            line.key,
            part_idx,
            num_parts,
            len(items),
            line.payload.get("encoder", "?"),
        )
        return Line(OK, line.key, {"parts": len(parts.items)})


async def push(
    host: str,
    port: int,
    req_id: str,
    part_idx: int,
    num_parts: int,
    items: list[str],
    sender: str,
    timeout_s: float,
) -> None:
    """The encoder side: deliver one part; PushFailed if it does not arrive."""
    where = f"{host}:{port}"
    subject = f"cannot push embeddings of request {req_id} to {where}"
    payload = {
        "part_idx": part_idx,
        "num_parts": num_parts,
        "items": [digest(item) for item in items],
        "encoder": sender,
    }
    try:
        answer = await exchange(host, port, Line(PUSH, req_id, payload), timeout_s)
    except ConnectionRefusedError:
        raise PushFailed(f"{subject}: connection refused", unreachable=True) from None
    except TimeoutError:
        raise PushFailed(f"{subject}: no answer within {timeout_s:.1f} s", True) from None
    except (OSError, ProtocolError) as exc:
        raise PushFailed(f"{subject}: {exc or type(exc).__name__}", unreachable=True) from None
    if answer.verb != OK:
        raise PushFailed(f"{subject}: {answer.payload.get('message', answer.verb)}", False)
