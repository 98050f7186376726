"""API keys on the main port: each call's key and its peer address decided, a refusal
counted and logged at a bounded rate, and the interceptor that applies them.

The keys themselves are `keys` (the keys file, read again when it changes), the per-address
failure bookkeeping `blocking` (`FailureTable`), the caller's principal `caller`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

import grpc
import structlog
from grpc import aio

from gateway.config import AuthConfig
from gateway.core import health
from gateway.core.tasks import TaskScope
from gateway.security.bearer import bearer
from gateway.security.blocking import LOG_EVERY_S, FailureTable, peer_address
from gateway.security.handlers import gated, refusing
from gateway.security.keys import ApiKeys, KeyFile

log = structlog.get_logger("gateway.security.auth")

# Open at the interceptor: `grpcurl list` needs reflection, and health Check and Watch
# decide from the name they are asked about (`HealthService`: the probes' names are
# open, the others need a key). Health List needs a key.
OPEN_PREFIXES = (
    health.CHECK,
    health.WATCH,
    "/grpc.reflection.",
)
MISSING_KEY = "this gateway needs the metadata 'authorization: Bearer <API key>'"
REJECTED_KEY = "the API key was not accepted"
THROTTLED = "too many failed attempts, retry later"

# Reasons, as the metric `gateway_auth_failures_total{reason}` labels them.
MISSING, REJECTED, BLOCKED = "missing", "rejected", "throttled"
REASONS = (MISSING, REJECTED, BLOCKED)
_MESSAGES = {MISSING: MISSING_KEY, REJECTED: REJECTED_KEY, BLOCKED: THROTTLED}

POLL_S = 1.0  # the keys file's stat is read this often: a removed key stops within 2 s


class ApiKeyAuth:
    """API keys on the main port: the current keys (`keys`, a `KeyFile` or fixed
    `ApiKeys`), the failure table, and the task that reads a changed keys file again.

    A refused call is counted (`count(reason)`, reason in REASONS) and may be logged,
    with its peer: grpc tells the peer only to the handler, not to an interceptor, so
    the refusal happens in a handler (`refusing`) and is counted there.

    A blocked address gets UNAUTHENTICATED "too many failed attempts, retry later" on
    every call, a correct key included (else a blocked guesser would still learn when
    it guessed right), and its keys are not looked at. UNAUTHENTICATED rather than
    RESOURCE_EXHAUSTED: the latter is this gateway's "overloaded, retry shortly" (with
    retry hints), which clients and their retry policies retry automatically; a client
    whose key is refused should not be made to hammer on. Clients behind one address (a
    NAT, an L7 proxy in front of the gateway) share its block: set `auth.failure_limit:
    0` there."""

    def __init__(
        self,
        keys: KeyFile | ApiKeys,
        config: AuthConfig | None = None,
        count: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        config = config if config is not None else AuthConfig()
        self.keys = keys
        self.failures = FailureTable(config.failure_limit, config.failure_window_s, config.block_s)
        self._count = count
        self.clock = clock
        self._poll_s = poll_s
        self._tasks = TaskScope()
        self._summary_at = clock()
        self._asked = asyncio.Event()  # a SIGHUP since the poll task last read the file
        self._door = ""  # what failures are counted under, beside the address

    def for_port(self, door: str) -> ApiKeyAuth:
        """The same keys, counts and failure table, for calls through another port: its
        failures are counted against `door` and the address, so they block that address
        there only (the picker's, whose peer is often a proxy many clients share)."""
        twin = copy.copy(self)
        twin._door = door + " "
        return twin

    @classmethod
    def from_config(
        cls, config: AuthConfig, count: Callable[[str], None] | None = None
    ) -> ApiKeyAuth | None:
        """None without `api_keys_file`; ConfigError if the file does not read."""
        if not config.api_keys_file:
            return None
        return cls(KeyFile(config.api_keys_file), config, count)

    def name_of(self, given: str | None) -> str | None:
        return self.keys.name_of(given)

    def interceptor(self, self_checked: tuple[str, ...] = ()) -> ApiKeyInterceptor:
        """`self_checked`: method prefixes whose handlers call `authenticate` themselves
        (the engine fronts, which read the metadata once for everything)."""
        return ApiKeyInterceptor(self, OPEN_PREFIXES + self_checked)

    # -- the keys file -------------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: the keys file read again at once by the poll task, off the loop (a bad
        file keeps the old keys). A storm of them costs one read at a time: those that
        come during a read ask for one more, after it (the file may have changed since)."""
        if isinstance(self.keys, KeyFile):
            self._asked.set()

    def start(self) -> None:
        """Start the task that polls the keys file (and logs failure summaries); needs a
        running event loop. A poll that raises is logged (once while it fails the same
        way): it is never the end of reloading."""
        if not self._tasks:
            self._tasks.supervise("api_keys_poll", self._run, pause_s=0.0)

    async def stop(self) -> None:
        await self._tasks.close()

    async def _run(self) -> None:
        asked = self._asked
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await asked.wait()
            if isinstance(self.keys, KeyFile):
                sighup = asked.is_set()
                asked.clear()
                await self.keys.refresh(asked=sighup)
            self.flush(self.clock())

    def flush(self, now: float) -> None:
        """At most once per LOG_EVERY_S: one line for the failures not logged one by one."""
        if now - self._summary_at < LOG_EVERY_S:
            return
        self._summary_at = now
        failures, peers = self.failures.summary()
        if failures:
            log.warning(
                "authentication failures not logged one by one",
                failures=failures,
                peers=peers,
            )

    # -- deciding ------------------------------------------------------------------------

    async def require(self, context: aio.ServicerContext, method: str = "") -> None:
        """Return if the call carries a known key from an address that is not blocked;
        else refuse it (counted, maybe logged, UNAUTHENTICATED)."""
        await self.authenticate(context, bearer(context.invocation_metadata()), method)

    async def authenticate(
        self, context: aio.ServicerContext, given: str | None, method: str = ""
    ) -> str:
        """The name of the key `given` (the call's bearer token, read by the caller), if
        known and the address is not blocked; else the call is refused (counted, maybe
        logged, UNAUTHENTICATED). The key is looked up once."""
        now = self.clock()
        address = self._door + peer_address(context.peer())
        if self.failures.active(now) and self.failures.blocked(address, now):
            await self.refuse(context, BLOCKED, method)
        if given is None:
            await self.refuse(context, MISSING, method)
        name = self.keys.name_of(given)
        if name is None:
            await self.refuse(context, REJECTED, method)
        return name

    async def refuse(self, context: aio.ServicerContext, reason: str, method: str) -> NoReturn:
        peer = context.peer()
        address, now = self._door + peer_address(peer), self.clock()
        failures = self.failures
        blocks = False
        if reason == BLOCKED or failures.blocked(address, now):
            reason = BLOCKED
        else:
            blocks = failures.fail(address, now)
        if self._count is not None:
            self._count(reason)
        if failures.loggable(address, now, must=blocks):
            if blocks:
                log.warning(
                    "peer blocked after failed authentications",
                    peer=peer,
                    reason=reason,
                    method=method,
                    failures=failures.limit,
                    within_s=failures.window_s,
                    blocked_s=failures.block_s,
                )
            else:
                log.warning("authentication failed", peer=peer, reason=reason, method=method)
        self.flush(now)
        # The failure that blocks the address already tells the block.
        message = THROTTLED if blocks else _MESSAGES[reason]
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        raise AssertionError("abort returned")  # pragma: no cover


class ApiKeyInterceptor(aio.ServerInterceptor):  # type: ignore[misc]
    """The main port: a known key on every call but those under OPEN_PREFIXES.

    Usually the key is looked up here and a refused call gets a handler that refuses
    without reading (`refusing`); a known key gets the method's own handler, at no cost.
    While some address is blocked, every call is instead checked in its handler, where
    its peer is known (`gated`): a blocked address is refused before its key is looked
    at."""

    def __init__(self, auth: ApiKeyAuth, open_prefixes: tuple[str, ...] = OPEN_PREFIXES) -> None:
        self._auth = auth
        self._open = open_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(self._open):
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        auth = self._auth
        if auth.failures.active(auth.clock()):
            return gated(handler, lambda context: auth.require(context, method))
        given = bearer(details.invocation_metadata)
        if given is None:
            return refusing(handler, lambda context: auth.refuse(context, MISSING, method))
        if auth.keys.name_of(given) is None:
            return refusing(handler, lambda context: auth.refuse(context, REJECTED, method))
        return handler
