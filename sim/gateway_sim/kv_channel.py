"""vLLM's NIXL-style KV side channel: the prefill's block server and the decode's fetch.

vLLM runs PD sequentially: the prefill (``do_remote_decode``) computes the prompt, keeps
its KV blocks and returns ``kv_transfer_params`` naming them and its side channel; the
router passes those verbatim to the decode (``do_remote_prefill``), which fetches the
blocks from ``remote_host:remote_port``. Wrong or missing params mean the decode cannot
fetch, and the request fails.

Protocol (TCP on the prefill's ``--kv-port``; framing in ``lines``, exchange in
``handoff``)::

    decode  -> prefill   WAIT <remote_request_id> {"wait_ms": 0}
    prefill -> decode    READY <remote_request_id> {"first_token": <id>,
                                                    "engine_id": <name>,
                                                    "block_ids": [...]}
                      or UNKNOWN <remote_request_id>

The decode asks with ``wait_ms`` 0: its prefill has already answered, so the blocks are
there or never will be. Blocks are fetched once and expire after 30 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway_sim.handoff import HandoffServer, KvTransferError, take
from gateway_sim.lines import ProtocolError

LABEL = "kv"
CONNECTOR = "NixlConnector"


def parse_params(raw: str) -> dict[str, Any] | None:
    """``kv_transfer_params_json`` as an object, or None if it is not a JSON object."""
    try:
        params = json.loads(raw)
    except ValueError:
        return None
    return params if isinstance(params, dict) else None


class KvChannel(HandoffServer):
    """The prefill's KV blocks, by request id, served on its side-channel port."""

    def __init__(self, host: str, port: int, engine_id: str, block_size: int) -> None:
        super().__init__(LABEL, host, port)
        self._host = host.strip("[]")
        self._engine_id = engine_id
        self._block_size = block_size
        self._next_block = 0

    def hand_over(
        self, request_id: str, first_token: int, prompt_tokens: int, cached_tokens: int
    ) -> dict[str, Any]:
        """Keep the KV of ``request_id`` for a decode; returns the transfer params the
        prefill's Complete carries: vLLM 0.32.0's NixlConnector's fields (the first token
        goes over the side channel, as the KV does)."""
        count = max(1, -(-prompt_tokens // self._block_size))
        blocks = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        self.publish(
            request_id,
            {"first_token": first_token, "engine_id": self._engine_id, "block_ids": blocks},
        )
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_host": self._host,
            "remote_port": self.port,
            "remote_block_ids": [blocks],  # one list per KV cache group
            "remote_request_id": request_id,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens,
        }


@dataclass(frozen=True, slots=True)
class Remote:
    """Where a decode's KV is, read from its ``kv_transfer_params``."""

    host: str
    port: int
    request_id: str
    engine_id: str | None

    @classmethod
    def of(cls, params: dict[str, Any]) -> Remote:
        """KvTransferError when the params do not say where the KV is (NIXL fails the
        request the same way on a missing field)."""
        host = params.get("remote_host")
        port = params.get("remote_port")
        request_id = params.get("remote_request_id")
        engine_id = params.get("remote_engine_id")
        if (
            not isinstance(host, str)
            or not host
            or not isinstance(port, int)
            or not 0 < port < 65536
            or not isinstance(request_id, str)
            or not request_id
        ):
            raise KvTransferError(
                "KV transfer failed: kv_transfer_params need remote_host, remote_port and "
                f"remote_request_id (got {json.dumps(params, sort_keys=True)[:200]})"
            )
        return cls(host, port, request_id, engine_id if isinstance(engine_id, str) else None)


async def fetch(remote: Remote, timeout_s: float) -> int:
    """Fetch the KV of ``remote.request_id``; returns the prefill's first token."""
    where = f"{remote.host}:{remote.port}"
    subject = f"KV transfer failed: request {remote.request_id} from {where}"
    try:
        value = await take(remote.host, remote.port, remote.request_id, 0.0, timeout_s)
    except ConnectionRefusedError:
        raise KvTransferError(f"{subject}: connection refused") from None
    except LookupError:
        raise KvTransferError(f"{subject}: no such request on that KV side channel") from None
    except TimeoutError:
        raise KvTransferError(f"{subject}: no answer within {timeout_s:.1f} s") from None
    except (OSError, ProtocolError) as exc:
        raise KvTransferError(f"{subject}: {exc or type(exc).__name__}") from None
    engine_id = value.get("engine_id")
    if remote.engine_id is not None and engine_id != remote.engine_id:
        raise KvTransferError(
            f"{subject}: that side channel is engine {engine_id!r}, not {remote.engine_id!r}"
        )
    first_token = value.get("first_token")
    if not isinstance(first_token, int):
        raise KvTransferError(f"{subject}: malformed handoff")
    return first_token
