"""API keys: the keys file (`name:key` lines) and its reading again.

The keys file is read again on SIGHUP (`ApiKeyAuth.reload`) and when it changes
(`ApiKeyAuth` polls its stat every second), by one task, in a thread (`KeyFile.refresh`):
a file of up to 1 MiB takes a read and a parse no event loop should wait for. A file that
does not read as keys leaves the previous keys in force.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Protocol

import structlog

from gateway.config import ConfigError
from gateway.core.files import Stamp, stamp

log = structlog.get_logger("gateway.security.auth")

MAX_KEYS_FILE_BYTES = 1 << 20
RACY_NS = 2_000_000_000  # a file changed this recently may change again unseen by its stat


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


# The file's stamp before it was read, and what reading it gave.
Read = tuple[Stamp | None, ApiKeys | ConfigError]


def _changed_lately(seen: Stamp | None) -> bool:
    """Changed within the last RACY_NS: a second change within the same timestamp tick,
    at the same size, would leave the stat as it is; such a file is read again at the
    next poll."""
    return seen is not None and time.time_ns() - seen.mtime_ns < RACY_NS


class KeyFile:
    """The keys of `path` as they are now: `keys` is replaced whole (one attribute store)
    on `reload()`, so a call sees the old keys or the new ones, never a mixture."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = stamp(path)
        self._racy = _changed_lately(self._stamp)
        self.keys = ApiKeys.load(path)  # a bad file stops start-up
        self._failed: tuple[Stamp | None, str] | None = None

    def name_of(self, given: str | None) -> str | None:
        return self.keys.name_of(given)

    def due(self) -> bool:
        """Its stat changed since it was read (or it was read right after a change)."""
        return self._racy or stamp(self.path) != self._stamp

    def poll(self) -> None:
        """Read the file again if it is `due`."""
        if self.due():
            self._apply(self._read(), quiet=True)

    def reload(self) -> bool:
        """Read the file now (SIGHUP). False, with a log line, if it does not read as
        keys: the previous keys stay."""
        return self._apply(self._read(), quiet=False)

    async def refresh(self, *, asked: bool) -> None:
        """`reload` when `asked` (SIGHUP), else `poll`; the file read and parsed in a
        thread, the keys replaced on the loop."""
        if asked or self.due():
            self._apply(await asyncio.to_thread(self._read), quiet=not asked)

    def _read(self) -> Read:
        found = stamp(self.path)  # before reading: a change meanwhile is seen next
        try:
            return found, ApiKeys.load(self.path)
        except ConfigError as exc:
            return found, exc

    def _apply(self, read: Read, quiet: bool) -> bool:
        self._stamp, keys = read
        self._racy = _changed_lately(self._stamp)
        if isinstance(keys, ConfigError):
            exc = keys
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
