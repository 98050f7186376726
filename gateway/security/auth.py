"""Who is calling: API keys on the main port, and the caller's principal.

The principal is the client certificate's identity (mTLS), else the name of the API key
the call carried, else none. It scopes what a caller may touch: an Abort reaches only
requests its own principal started.

The keys file is read again on SIGHUP (`ApiKeyAuth.reload`) and when it changes (a task
polls its stat every second); a file that does not read as keys leaves the previous keys
in force. Failed authentications are counted, logged at a bounded rate, and a peer
address that fails too often is refused for a while (`FailureTable`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import ipaddress
import math
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol
from urllib.parse import unquote

import grpc
import structlog
from grpc import aio

from gateway.config import AuthConfig, ConfigError
from gateway.core.tasks import TaskScope

log = structlog.get_logger("gateway.security.auth")

AUTHORIZATION = "authorization"
# Open at the interceptor: `grpcurl list` needs reflection, and health Check and Watch
# decide from the name they are asked about (`HealthService`: the probes' names are
# open, the others need a key). Health List needs a key.
OPEN_PREFIXES = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.",
)
MISSING_KEY = "this gateway needs the metadata 'authorization: Bearer <API key>'"
REJECTED_KEY = "the API key was not accepted"
THROTTLED = "too many failed attempts, retry later"

# Reasons, as the metric `gateway_auth_failures_total{reason}` labels them.
MISSING, REJECTED, BLOCKED = "missing", "rejected", "throttled"
REASONS = (MISSING, REJECTED, BLOCKED)
_MESSAGES = {MISSING: MISSING_KEY, REJECTED: REJECTED_KEY, BLOCKED: THROTTLED}

MAX_KEYS_FILE_BYTES = 1 << 20
POLL_S = 1.0  # the keys file's stat is read this often: a removed key stops within 2 s
RACY_NS = 2_000_000_000  # a file changed this recently may change again unseen by its stat
MAX_PEERS = 10_000  # peer addresses the failure table remembers (~200 B each)
LOG_EVERY_S = 10.0  # one failure line per peer address per this long ...
MAX_LINES = 20  # ... and at most this many lines over all peers; a summary for the rest


def bearer_token(value: str) -> str | None:
    """X of an `authorization: Bearer X` value."""
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            token = bearer_token(value)
            if token is not None:
                return token
    return None


Refusal = Callable[[aio.ServicerContext], Awaitable[None]]


def refusing(handler: grpc.RpcMethodHandler, refuse: Refusal) -> grpc.RpcMethodHandler:
    """A handler for `handler`'s method that only runs `refuse` (which aborts the call).

    Request-streaming whatever the method's shape, and it never reads: a handler of the
    method's own shape would have grpc read the whole request (up to `max_message_bytes`)
    before the refusal. The wire is the same for the client; its sending is cut short."""

    async def run(_requests: Any, context: aio.ServicerContext) -> None:
        await refuse(context)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            run, response_serializer=handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        run, response_serializer=handler.response_serializer
    )


def deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler for `handler`'s method that refuses the call (UNAUTHENTICATED `message`)
    without reading its request."""

    async def refuse(context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refusing(handler, refuse)


def gated(handler: grpc.RpcMethodHandler, admit: Refusal) -> grpc.RpcMethodHandler:
    """`handler` behind `admit(context)` (which aborts the call or returns), run before
    the request is read: request-streaming whatever the method's shape, a unary request
    read here after `admit` and handed to the method's own behavior."""
    behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    streaming_request = handler.request_streaming

    async def request_of(requests: Any, context: aio.ServicerContext) -> Any:
        if streaming_request:
            return requests
        async for request in requests:
            return request
        await context.abort(grpc.StatusCode.INTERNAL, "half-closed without a request")

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.response_streaming and inspect.isasyncgenfunction(behavior):

        async def relay(requests: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            await admit(context)
            async for response in behavior(await request_of(requests, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(relay, **codecs)

    async def run(requests: Any, context: aio.ServicerContext) -> Any:
        await admit(context)
        result = behavior(await request_of(requests, context), context)
        return await result if inspect.isawaitable(result) else result

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(run, **codecs)
    return grpc.stream_unary_rpc_method_handler(run, **codecs)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeySource(Protocol):
    def name_of(self, given: str | None) -> str | None: ...


class ApiKeys:
    """`name:key` lines; blank lines and `#` comments ignored.

    Looked up by the SHA-256 of the key: one dict lookup whatever the number of keys, and
    its timing tells only how much of the digest of what the caller sent matches a stored
    digest, which says nothing about any key (no key-by-key comparison to time)."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._by_digest = {_digest(key): name for name, key in keys.items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def by_name(self) -> dict[str, bytes]:
        return {name: digest for digest, name in self._by_digest.items()}

    @classmethod
    def load(cls, path: str) -> ApiKeys:
        what = f"auth.api_keys_file {path!r}"
        try:
            with open(path, "rb") as file:
                raw = file.read(MAX_KEYS_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{what}: {exc.strerror or exc}") from None
        if len(raw) > MAX_KEYS_FILE_BYTES:
            raise ConfigError(f"{what} is larger than {MAX_KEYS_FILE_BYTES} bytes")
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise ConfigError(f"{what} is not UTF-8 text") from None
        keys: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, key = line.partition(":")
            if not sep or not name.strip() or len(key.strip()) < 16:
                raise ConfigError(
                    f"{what} line {number}: expected name:key (a key of 16 characters or more)"
                )
            keys[name.strip()] = key.strip()
        if not keys:
            raise ConfigError(f"{what} has no keys")
        return cls(keys)

    def name_of(self, given: str | None) -> str | None:
        """The key's name, or None if it is not a key."""
        if given is None:
            return None
        return self._by_digest.get(_digest(given))


Stamp = tuple[int, int, int, int, int] | None


def _stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class KeyFile:
    """The keys of `path` as they are now: `keys` is replaced whole (one attribute store)
    on `reload()`, so a call sees the old keys or the new ones, never a mixture."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = _stamp(path)
        self._racy = self._changed_lately()
        self.keys = ApiKeys.load(path)  # a bad file stops start-up
        self._failed: tuple[Stamp, str] | None = None

    def name_of(self, given: str | None) -> str | None:
        return self.keys.name_of(given)

    def _changed_lately(self) -> bool:
        """Changed within the last RACY_NS: a second change within the same timestamp
        tick, at the same size, would leave the stat as it is; such a file is read again
        at the next poll."""
        return self._stamp is not None and time.time_ns() - self._stamp[3] < RACY_NS

    def poll(self) -> None:
        """Read the file again if its stat changed since it was read (or it was read
        right after a change)."""
        if self._racy or _stamp(self.path) != self._stamp:
            self._reload(quiet=True)

    def reload(self) -> bool:
        """Read the file now (SIGHUP). False, with a log line, if it does not read as
        keys: the previous keys stay."""
        return self._reload(quiet=False)

    def _reload(self, quiet: bool) -> bool:
        self._stamp = _stamp(self.path)  # before reading: a change meanwhile is seen next
        self._racy = self._changed_lately()
        try:
            keys = ApiKeys.load(self.path)
        except ConfigError as exc:
            failure = (self._stamp, str(exc))
            if not quiet or failure != self._failed:  # one line per broken version
                log.warning(
                    "api keys not reloaded: keeping the previous keys",
                    error=str(exc),
                    keys=len(self.keys),
                )
            self._failed = failure
            return False
        self._failed = None
        before, after = self.keys.by_name, keys.by_name
        self.keys = keys
        if before != after:
            log.info(
                "api keys reloaded",
                keys=len(after),
                added=sorted(set(after) - set(before)),
                removed=sorted(set(before) - set(after)),
                changed=sorted(n for n in set(before) & set(after) if before[n] != after[n]),
            )
        elif not quiet:
            log.info("api keys reloaded", keys=len(after), unchanged=True)
        return True


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
        """SIGHUP: read the keys file now (synchronous; a bad file keeps the old keys)."""
        if isinstance(self.keys, KeyFile):
            self.keys.reload()

    def start(self) -> None:
        """Start the task that polls the keys file (and logs failure summaries); needs a
        running event loop. A poll that raises is logged (once while it fails the same
        way): it is never the end of reloading."""
        if not self._tasks:
            self._tasks.supervise("api_keys_poll", self._run, pause_s=0.0)

    async def stop(self) -> None:
        await self._tasks.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            if isinstance(self.keys, KeyFile):
                self.keys.poll()
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
        if self.failures.active(now) and self.failures.blocked(peer_address(context.peer()), now):
            await self.refuse(context, BLOCKED, method)
        if given is None:
            await self.refuse(context, MISSING, method)
        name = self.keys.name_of(given)
        if name is None:
            await self.refuse(context, REJECTED, method)
        return name

    async def refuse(self, context: aio.ServicerContext, reason: str, method: str) -> NoReturn:
        peer = context.peer()
        address, now = peer_address(peer), self.clock()
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


class BearerInterceptor(aio.ServerInterceptor):  # type: ignore[misc]
    """Every call (but those under `open_prefixes`) must carry `authorization: Bearer X`
    with an X that `accepts`, else UNAUTHENTICATED. An interceptor rather than a check in
    each method, so nothing served can be reached without it, methods added later too."""

    def __init__(
        self,
        accepts: Callable[[str], bool],
        missing: str,
        rejected: str,
        open_prefixes: tuple[str, ...] = (),
    ) -> None:
        self._accepts = accepts
        self._missing, self._rejected = missing, rejected
        self._open = open_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or (self._open and details.method.startswith(self._open)):
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        given = bearer(details.invocation_metadata)
        if given is None:
            return deny(handler, self._missing)
        if not self._accepts(given):
            return deny(handler, self._rejected)
        return handler


class Caller:
    """Tells who a call comes from, where the gateway knows callers at all (client
    certificates or API keys); everyone is nobody otherwise, at no cost per call.

    `keys`: anything with `name_of` (an `ApiKeyAuth`, a `KeyFile`): asked on every call,
    so a reloaded file takes effect at once."""

    def __init__(self, keys: KeySource | None = None, certificates: bool = False) -> None:
        self._keys = keys
        self._certificates = certificates
        self.known = keys is not None or certificates
        # The API key authenticates the caller to the gateway: it never goes upstream.
        self.private_keys = frozenset({AUTHORIZATION}) if keys is not None else frozenset()

    async def identify(
        self, context: aio.ServicerContext, given: str | None, method: str
    ) -> str | None:
        """For a handler that authenticates its calls itself: with API keys on, the call
        must carry a known key (`given`: its bearer token) or it is refused; then its
        principal, the key looked up once."""
        name = None
        if isinstance(self._keys, ApiKeyAuth):
            name = await self._keys.authenticate(context, given, method)
        return self.principal(context, name)

    def principal(self, context: aio.ServicerContext, key_name: str | None = None) -> str | None:
        """The client certificate's name (mTLS), else the API key's name, else None.
        `key_name`: the key already authenticated for this call (then it is not looked
        up again)."""
        if not self.known:
            return None
        if self._certificates:
            auth = context.auth_context() or {}
            for field in ("x509_common_name", "x509_subject_alternative_name"):
                values = auth.get(field)
                if values:
                    return "cert:" + bytes(values[0]).decode(errors="replace")
        if key_name is None and self._keys is not None:
            key_name = self._keys.name_of(bearer(context.invocation_metadata()))
        return None if key_name is None else "key:" + key_name
