"""A serving process of `gateway serve --processes N`, started by the supervisor as
`python -m gateway.scale.child FILE`, FILE holding its `Launch` (in the supervisor's
private directory)."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.scale.member import Member

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Launch:
    """What one serving process starts with: the config (main port, control socket and
    fleet filled in by the supervisor), its place, and the workers to start drained."""

    config: GatewayConfig
    member: Member
    drained: tuple[str, ...]
    supervisor_pid: int


def die_with(parent_pid: int) -> None:
    """Drain and exit when the supervisor dies, even by SIGKILL (Linux), instead of
    serving on as an orphan nobody restarts or stops."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    from gateway.cli import run_until_done
    from gateway.logs import configure
    from gateway.server import serve

    launch: Launch = pickle.loads(Path(argv[1]).read_bytes())
    die_with(launch.supervisor_pid)
    config, member = launch.config, launch.member
    configure(config.log_format, config.log_level, process=member.index)
    return run_until_done(serve(config, member, launch.drained))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
