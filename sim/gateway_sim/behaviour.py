"""What a simulated request does: the knobs, and their per-request overrides.

The process-wide knobs come from the command line; a request may override any of them
with ``x-sim-*`` metadata so a test can inject a failure into one request that travels
through the gateway without restarting the worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

OVERRIDE_PREFIX = "x-sim-"
TOKENS_KEY = "x-sim-tokens"
TTFT_MS_KEY = "x-sim-ttft-ms"
TOKEN_MS_KEY = "x-sim-token-ms"
FAIL_CODE_KEY = "x-sim-fail-code"
FAIL_AFTER_KEY = "x-sim-fail-after"
STALL_KEY = "x-sim-stall"
EXIT_AFTER_KEY = "x-sim-exit-after"
TOKENS_PER_CHUNK_KEY = "x-sim-tokens-per-chunk"
HEADERS_FIRST_KEY = "x-sim-headers-first"
# SGLang: an Abort ends the aborted stream with a Complete `abort`, as vLLM's does (the
# real SGLang servicer sends nothing more: the stream stays open until its deadline).
ABORT_COMPLETES_KEY = "x-sim-abort-completes"
# The completion_tokens every chunk and Complete reports, whatever was generated: a
# worker whose usage figures lie (the gateway must not believe them past what it asked).
COMPLETION_TOKENS_KEY = "x-sim-completion-tokens"
MAX_REPORTED_TOKENS = 2**32 - 1  # completion_tokens is a uint32 in both protos

OVERRIDE_KEYS = (
    TOKENS_KEY,
    TTFT_MS_KEY,
    TOKEN_MS_KEY,
    FAIL_CODE_KEY,
    FAIL_AFTER_KEY,
    STALL_KEY,
    EXIT_AFTER_KEY,
    TOKENS_PER_CHUNK_KEY,
    HEADERS_FIRST_KEY,
    ABORT_COMPLETES_KEY,
    COMPLETION_TOKENS_KEY,
)

# Values that switch an optional knob off, so a request can undo a command-line setting.
_OFF = frozenset({"", "none", "off", "0", "false", "no", "ok"})
_ON = frozenset({"1", "true", "yes", "on"})


# Boolean overrides: the Behaviour field each sets.
_FLAGS = {
    STALL_KEY: "stall",
    HEADERS_FIRST_KEY: "headers_first",
    ABORT_COMPLETES_KEY: "abort_completes",
}


class BadOverride(ValueError):
    """A request carried an ``x-sim-*`` value the worker cannot read."""


def parse_status_code(name: str) -> grpc.StatusCode:
    """Map a status name such as ``UNAVAILABLE`` (any case) to a non-OK status code."""
    try:
        code = grpc.StatusCode[name.strip().upper()]
    except KeyError:
        raise ValueError(f"unknown gRPC status code {name!r}") from None
    if code is grpc.StatusCode.OK:
        raise ValueError("a simulated failure cannot have status OK")
    return code


@dataclass(frozen=True, slots=True)
class Behaviour:
    """How the worker answers a Generate or Embed call.

    ``fail_code``/``exit_after``: when set, the request never ends OK. The failure (or
    the process exit) fires once ``fail_after``/``exit_after`` response messages have
    been sent, or at the end of the stream if it has fewer messages than that.
    ``tokens_per_chunk``: tokens a streamed chunk carries, as an engine batches the
    tokens of several steps when its reader lags. ``headers_first``: Generate's headers
    go as soon as the call is taken, not with its first message as the real servicers
    send them (a test that waits for a call to be running reads them).
    ``completion_tokens``: when set, the usage every chunk and Complete reports instead
    of the count the engine's dialect gives (a lying worker). ``abort_completes``: an
    aborted SGLang stream ends with a Complete ``abort`` as a vLLM one does, for tests
    that wait on that end (the real SGLang servicer never ends it: its deadline does).
    """

    tokens: int = 16
    ttft_ms: float = 0.0
    token_ms: float = 0.0
    fail_code: grpc.StatusCode | None = None
    fail_after: int = 0
    exit_after: int | None = None
    stall: bool = False
    tokens_per_chunk: int = 1
    headers_first: bool = False
    completion_tokens: int | None = None
    abort_completes: bool = False

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.ttft_ms < 0 or self.token_ms < 0 or self.fail_after < 0:
            raise ValueError("tokens, delays and fail_after must not be negative")
        if self.tokens_per_chunk < 1:
            raise ValueError("tokens_per_chunk must be at least 1")
        if self.exit_after is not None and self.exit_after < 0:
            raise ValueError("exit_after must not be negative")
        if self.completion_tokens is not None and not (
            0 <= self.completion_tokens <= MAX_REPORTED_TOKENS
        ):
            raise ValueError(f"completion_tokens must be within 0..{MAX_REPORTED_TOKENS}")

    @property
    def trigger_at(self) -> int:
        """Message count at which the failure or exit fires; -1 when neither is set."""
        points = []
        if self.fail_code is not None:
            points.append(self.fail_after)
        if self.exit_after is not None:
            points.append(self.exit_after)
        return min(points) if points else -1


@dataclass(frozen=True, slots=True)
class RequestView:
    """What one request's metadata says: its effective behaviour and the keys it carried."""

    behaviour: Behaviour
    seen_keys: str
    traceparent: str = ""  # the W3C trace context it came with, if any


def _int(key: str, value: str) -> int:
    try:
        parsed = int(value)
    except ValueError:
        raise BadOverride(f"{key}: {value!r} is not an integer") from None
    if parsed < 0:
        raise BadOverride(f"{key}: {value!r} is negative")
    return parsed


def _ms(key: str, value: str) -> float:
    try:
        parsed = float(value)
    except ValueError:
        raise BadOverride(f"{key}: {value!r} is not a number") from None
    if not parsed >= 0:  # also rejects NaN
        raise BadOverride(f"{key}: {value!r} is negative")
    return parsed


def _reported_tokens(key: str, value: str) -> int | None:
    """A usage figure to report (off: the true count), within the protos' uint32."""
    if value.lower() in ("", "none", "off"):
        return None
    parsed = _int(key, value)
    if parsed > MAX_REPORTED_TOKENS:
        raise BadOverride(f"{key}: {value!r} is over {MAX_REPORTED_TOKENS} (uint32)")
    return parsed


def _apply(base: Behaviour, overrides: dict[str, str]) -> Behaviour:
    changes: dict[str, Any] = {}
    for key, raw in overrides.items():
        value = raw.strip()
        if key == TOKENS_KEY:
            changes["tokens"] = _int(key, value)
        elif key == TTFT_MS_KEY:
            changes["ttft_ms"] = _ms(key, value)
        elif key == TOKEN_MS_KEY:
            changes["token_ms"] = _ms(key, value)
        elif key == FAIL_CODE_KEY:
            if value.lower() in _OFF:
                changes["fail_code"] = None
            else:
                try:
                    changes["fail_code"] = parse_status_code(value)
                except ValueError as exc:
                    raise BadOverride(f"{key}: {exc}") from None
        elif key == FAIL_AFTER_KEY:
            changes["fail_after"] = _int(key, value)
        elif key in _FLAGS:
            lowered = value.lower()
            if lowered not in _ON and lowered not in _OFF:
                raise BadOverride(f"{key}: {value!r} is not a boolean")
            changes[_FLAGS[key]] = lowered in _ON
        elif key == TOKENS_PER_CHUNK_KEY:
            per_chunk = _int(key, value)
            if per_chunk < 1:
                raise BadOverride(f"{key}: {value!r} is not a positive integer")
            changes["tokens_per_chunk"] = per_chunk
        elif key == COMPLETION_TOKENS_KEY:
            changes["completion_tokens"] = _reported_tokens(key, value)
        elif key == EXIT_AFTER_KEY:
            changes["exit_after"] = (
                None if value.lower() in ("", "none", "off") else _int(key, value)
            )
        # Unknown x-sim-* keys are ignored: they may belong to a newer test harness.
    return dataclasses.replace(base, **changes) if changes else base


def read_request(base: Behaviour, metadata: Iterable[tuple[str, str | bytes]]) -> RequestView:
    """Read one request's metadata in a single pass.

    Returns the base behaviour itself when the request overrides nothing, so the common
    case allocates nothing beyond the seen-keys string.
    """
    keys: set[str] = set()
    overrides: dict[str, str] | None = None
    traceparent = ""
    for key, value in metadata:
        keys.add(key)
        if key == "traceparent" and isinstance(value, str):
            traceparent = value
        if key.startswith(OVERRIDE_PREFIX) and isinstance(value, str):
            if overrides is None:
                overrides = {}
            overrides[key] = value
    behaviour = base if overrides is None else _apply(base, overrides)
    return RequestView(behaviour, ",".join(sorted(keys)), traceparent)
