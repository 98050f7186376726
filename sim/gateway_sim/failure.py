"""Failure injection: how a simulated worker fails a call (the status it was told, the
``x-sim-failure`` trailer naming the worker) or dies like a crashed process, at the
point its behaviour says (``--fail-code``/``--fail-after``, ``--exit-after``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any, NoReturn

import grpc
from grpc.aio import ServicerContext

from gateway_sim.behaviour import Behaviour

log = logging.getLogger("gateway_sim")

# The trailer the tests read: which worker failed the call.
FAILURE_TRAILER = "x-sim-failure"
FAILURE_DETAILS = "simulated failure"

# How long a dying worker waits for its last written messages to leave the socket.
_EXIT_FLUSH_S = 0.05


async def fire(
    context: ServicerContext[Any, Any], behaviour: Behaviour, sent: int, worker: str
) -> None:
    """Fire whichever of exit/failure owns the trigger point (exit on a tie)."""
    if behaviour.exit_after is not None and behaviour.exit_after == behaviour.trigger_at:
        await crash(worker, sent)
    if behaviour.fail_code is not None:
        await fail(context, behaviour.fail_code, worker)


async def fail(context: ServicerContext[Any, Any], code: grpc.StatusCode, worker: str) -> NoReturn:
    """End the call with ``code``, the trailer naming ``worker``."""
    await context.abort(code, FAILURE_DETAILS, ((FAILURE_TRAILER, worker),))
    raise AssertionError("unreachable")


async def crash(worker: str, sent: int) -> NoReturn:
    """Die like a crashed worker: no graceful shutdown, connections reset."""
    if sent:
        await asyncio.sleep(_EXIT_FLUSH_S)
    log.warning("%s: simulated crash after %d messages", worker, sent)
    for handler in log.handlers:
        handler.flush()
    sys.stdout.flush()
    os._exit(1)
