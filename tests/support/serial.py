"""How the tests share a machine when pytest-xdist runs them side by side: the run lock
(see tests/conftest.py, where its hooks take and release it) and `run_alone`, for a test
whose measurement starts after its processes are up."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO


class RunLock:
    """A readers-writer lock between the workers of one run (flock on two files),
    held by one test at a time in each worker."""

    def __init__(self, directory: Path) -> None:
        self._turnstile: IO[bytes] = open(directory / "turnstile", "ab")  # noqa: SIM115
        self._run: IO[bytes] = open(directory / "run", "ab")  # noqa: SIM115
        self.exclusive = False  # what this worker holds now, if it holds the lock

    def acquire(self, exclusive: bool) -> None:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            raise
        if not exclusive:  # the next one may come in (an exclusive hold keeps it)
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.exclusive = exclusive

    def release(self) -> None:
        fcntl.flock(self._run, fcntl.LOCK_UN)
        if self.exclusive:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        self.exclusive = False

    def close(self) -> None:
        self._turnstile.close()
        self._run.close()


_run_lock: RunLock | None = None  # this worker's, under xdist


def install(lock: RunLock | None) -> None:
    """This worker's run lock (None: no longer any); tests/conftest.py's pytest_configure
    and pytest_unconfigure set it."""
    global _run_lock
    _run_lock = lock


def current() -> RunLock | None:
    return _run_lock


def run_alone() -> None:
    """From here to its end (teardown included), this test runs with no test of another
    worker running: for a test whose measurement starts after it has started its
    processes. Call it before anything that must not wait: it waits (blocking, the event
    loop too) for the other worker's test to end, which can take seconds. A no-op without
    xdist, or when the test runs alone already."""
    lock = _run_lock
    if lock is None or lock.exclusive:
        return
    lock.release()
    lock.acquire(exclusive=True)
