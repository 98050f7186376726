"""The `gateway` command (console script) and `python -m gateway`.

SIGINT and SIGTERM are made quiet first, before the command line and whatever its command
needs (grpc, numpy, the server) are imported: a Ctrl-C at any instant of the start-up ends
the process with 130 and no traceback. Output into a pipe its reader closed
(`gateway workers list | head`) ends it quietly too, with 141 as a shell's SIGPIPE would.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from gateway.app.run import quiet_signals


def main(argv: Sequence[str] | None = None) -> int:
    quiet_signals()
    try:
        from gateway.cli.main import main as command

        code = command(argv)
    except KeyboardInterrupt:  # a Ctrl-C the work let through as KeyboardInterrupt
        code = 130
    except BrokenPipeError:  # the reader of stdout went away: nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit does not fail again
        code = 141
    # On the way out (threads joined, buffers flushed) a signal ends it quietly too.
    quiet_signals()
    return code


if __name__ == "__main__":
    sys.exit(main())
