"""How a gateway process starts and ends: quiet signals while it starts, and running its
coroutine to the end.

Imports nothing slow at module level: `gateway` and `python -m gateway` (`gateway.__main__`)
load it first, before anything else of theirs, so that a Ctrl-C at any instant of the
start-up ends the process quietly. Shared by the command line (`gateway.cli.main`) and the
serving processes of `--processes N` (`gateway.scale.child`), which is why it is not in
`gateway.cli.main`: nothing under `gateway/` imports the command line but its entry point.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType

QUIET = (signal.SIGINT, signal.SIGTERM)

_Handler = Callable[[int, FrameType | None], object] | int | None
_saved: dict[signal.Signals, _Handler] = {}
# What a signal that was ignored at start becomes: Python's own for SIGINT
# (KeyboardInterrupt), the default action for SIGTERM.
_DEFAULTS: dict[signal.Signals, _Handler] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
}


def say(line: str) -> None:
    """One line on stderr, written at once (the serving processes of `--processes N`
    share it, and print() would write the newline apart): `gateway: LINE`, or a JSON
    line where the logs are JSON (`gateway.observability.logs.say`)."""
    from gateway.observability.logs import say as write

    write(line)


def _exit_now(signum: int, frame: FrameType | None) -> None:
    os._exit(128 + signum)  # 130 for SIGINT, 143 for SIGTERM


def quiet_signals() -> None:
    """From now until `own_signals`, SIGINT and SIGTERM end the process at once, with
    128 + the signal number (130 for Ctrl-C) and nothing on stderr, whatever it is doing
    (importing, parsing flags, reading the config, exiting): no KeyboardInterrupt, so no
    traceback. Only while the process holds nothing that needs stopping: it starts no
    other process and opens no port before `own_signals`.

    A signal the process was started with ignored (a background job of a
    non-interactive shell ignores SIGINT) gets its default back, as servers do: a gateway
    always stops on SIGINT and SIGTERM (nohup ignores SIGHUP only)."""
    for sig in QUIET:
        current = signal.getsignal(sig)
        if current is signal.SIG_IGN:
            current = _DEFAULTS[sig]
        if current is not _exit_now:
            _saved[sig] = current
        signal.signal(sig, _exit_now)


def own_signals() -> None:
    """Give SIGINT and SIGTERM back (to Python's KeyboardInterrupt and the default action,
    which the event loop and the server then take over): called just before the work
    starts, so that a Ctrl-C stops it the way it is meant to stop (a drain, the demo's
    workers stopped)."""
    for sig, previous in _saved.items():
        signal.signal(sig, signal.SIG_DFL if previous is None else previous)
    _saved.clear()


def on_loop(coro: object) -> object:
    """Run `coro` on the event loop `GATEWAY_LOOP` names (`uvloop`, else asyncio's own);
    the scripts measured against the gateway run on the same one."""
    import asyncio

    if os.environ.get("GATEWAY_LOOP") == "uvloop":
        import uvloop

        return uvloop.run(coro)  # type: ignore[arg-type]
    return asyncio.run(coro)  # type: ignore[arg-type]


def run_until_done(coro: object) -> int:
    """Run to the end; 2 with one line if a port cannot be bound, 130 on a Ctrl-C that
    arrived before the process took over its signals (never a traceback)."""
    from gateway.config import ConfigError
    from gateway.core.listen import CannotListen

    result: object = None
    own_signals()
    try:
        result = on_loop(coro)
    except CannotListen as exc:
        say(str(exc))
        return 2
    except ConfigError as exc:  # found at start-up: an unreadable certificate or key file
        say(f"config error: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130
    return result if isinstance(result, int) else 0
