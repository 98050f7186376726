"""A serving process of `gateway serve --processes N`, started by the supervisor as
`python -m gateway.scale.child FILE`, FILE holding its `Launch` (in the supervisor's
private directory)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pickle
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.app.run import quiet_signals, run_until_done

if TYPE_CHECKING:  # the process imports them (and the server) once its signals are quiet
    from gateway.config import GatewayConfig
    from gateway.discovery.source import Discovered
    from gateway.scale.member import Member

PR_SET_PDEATHSIG = 1
PARENT_DIED = signal.SIGRTMIN  # the parent-death signal: one SIGTERM, however often it comes


@dataclass(frozen=True, slots=True)
class Launch:
    """What one serving process starts with: the config (main port, control socket and
    fleet filled in by the supervisor), its place, the workers to start drained, and what
    the supervisor's discovery sources reported so far."""

    config: GatewayConfig
    member: Member
    drained: tuple[str, ...]
    supervisor_pid: int
    discovered: dict[str, list[Discovered]] = field(default_factory=dict)


class Orphan:
    """Whether the supervisor died: its death signal came, or another process adopted
    this one. (The signal can come before the adoption: a dying process hands its
    children to its other threads first, so the parent's pid stays the same a while.)"""

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self.told = False

    def __bool__(self) -> bool:
        return self.told or os.getppid() != self.parent_pid


def die_with(parent_pid: int) -> Orphan:
    """Drain and exit when the supervisor dies, even by SIGKILL (Linux), instead of
    serving on as an orphan nobody restarts or stops.

    The kernel sends the parent-death signal each time the child is handed to another
    thread of the dying supervisor, then once more: one death, several signals. A second
    SIGTERM means "stop now" and a late one (after the server let go of SIGTERM) kills the
    process before it cleans up, so the kernel sends `PARENT_DIED` instead, which turns
    into exactly one SIGTERM."""
    orphan = Orphan(parent_pid)

    def once(signum: int, frame: object) -> None:
        if not orphan.told:
            orphan.told = True
            os.kill(os.getpid(), signal.SIGTERM)

    if sys.platform.startswith("linux"):
        signal.signal(PARENT_DIED, once)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, PARENT_DIED)
    if orphan:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)
    return orphan


def share_directory(directory: str) -> int | None:
    """Hold a shared lock on the supervisor's private directory for this process's life
    (the lock goes with the process, however it ends); None if the directory is gone
    (the supervisor is gone too: this process is about to stop)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def tidy(directory: str, lock: int | None, orphaned: bool) -> None:
    """On the way out: if the supervisor died without removing its private directory
    (killed outright), the last serving process to leave removes it. Each one drops its
    shared lock, then tries for an exclusive one without waiting: whoever gets it held
    the last lock, and the last one to drop its shared lock always gets it."""
    if lock is None:
        return
    try:
        if not orphaned:
            return  # the supervisor lives: it removes its directory itself
        fcntl.flock(lock, fcntl.LOCK_UN)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # a sibling still runs: the last one removes it
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            os.close(lock)


def main(argv: list[str]) -> int:
    # A SIGHUP before the server takes it over (it reloads then) must not end the process;
    # a SIGINT or SIGTERM ends it quietly until `run_until_done` hands them to the server.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    quiet_signals()
    from gateway.app.server import serve
    from gateway.observability.corelog import install

    launch: Launch = pickle.loads(Path(argv[1]).read_bytes())
    lock = share_directory(launch.member.control_dir)
    orphan = die_with(launch.supervisor_pid)
    config, member = launch.config, launch.member
    install(config.log_format, config.log_level, process=str(member.index))

    def reread() -> GatewayConfig:  # the supervisor wrote it again before its SIGHUP
        again: Launch = pickle.loads(Path(argv[1]).read_bytes())
        return again.config

    try:
        return run_until_done(
            serve(config, member, launch.drained, launch.discovered, reread=reread)
        )
    finally:
        # The server has let go of the signals: none may end the process mid-clean-up.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        tidy(member.control_dir, lock, bool(orphan))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
