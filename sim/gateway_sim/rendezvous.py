"""SGLang's PD bootstrap rendezvous: the prefill's bootstrap server and the decode's wait
for a room.

In SGLang the same request goes to prefill and decode at once, both carrying
``disaggregated_params{bootstrap_host, bootstrap_port, bootstrap_room}``. The prefill
serves a bootstrap server on its bootstrap port; the decode connects to
``bootstrap_host:bootstrap_port`` and receives the KV of ``bootstrap_room`` once the
prefill has computed it. A wrong host or port means the decode cannot reach the prefill;
a wrong room means its KV never arrives; either way the decode fails.

Protocol (TCP on the prefill's bootstrap port; framing in ``lines``, exchange in
``handoff``)::

    decode  -> prefill   WAIT <room> {"wait_ms": <decode's --bootstrap-timeout-ms>}
    prefill -> decode    READY <room> {"first_token": <id>}
                      or UNKNOWN <room>         (room not ready within wait_ms)

The prefill marks a room ready after its time to first token, holding the first output
token; the
decode starts its output from that token. A room is handed over once; an unclaimed room
expires after 30 s.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway_sim.handoff import HandoffServer, KvTransferError, take
from gateway_sim.lines import ProtocolError

LABEL = "bootstrap"


@dataclass(frozen=True, slots=True)
class Room:
    """What the prefill hands the decode through a room."""

    first_token: int


class BootstrapServer(HandoffServer):
    """The prefill's rendezvous table, served on its bootstrap port."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(LABEL, host, port)

    def mark_ready(self, room: int, handoff: Room) -> None:
        self.publish(str(room), {"first_token": handoff.first_token})


async def wait_room(host: str, port: int, room: int, timeout_s: float) -> Room:
    """Wait (at most ``timeout_s``) for ``room`` from the bootstrap server at
    ``host:port``; KvTransferError, worded like SGLang's decode, if it does not come."""
    where = f"{host}:{port}"
    try:
        value = await take(host, port, str(room), timeout_s, timeout_s)
    except ConnectionRefusedError:
        raise KvTransferError(
            f"KV transfer failed: bootstrap server {where} refused the connection "
            f"(bootstrap room {room})"
        ) from None
    except (LookupError, TimeoutError):
        raise KvTransferError(
            f"KV transfer failed: bootstrap room {room} not received from {where} "
            f"within {timeout_s:.1f} s"
        ) from None
    except (OSError, ProtocolError) as exc:
        raise KvTransferError(
            f"KV transfer failed: bootstrap room {room} from {where}: {exc or type(exc).__name__}"
        ) from None
    try:
        first_token = value["first_token"]
        if not isinstance(first_token, int):
            raise TypeError(first_token)
        return Room(first_token)
    except (KeyError, TypeError):
        raise KvTransferError(
            f"KV transfer failed: bootstrap room {room} from {where}: malformed handoff"
        ) from None
