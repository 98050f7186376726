"""Simulated workers for the end-to-end tests, many in one process (`python -m
tests.e2e.simhost`, started by tests/support/launch.py's SimHost).

A simulated worker is a test double: starting a Python process for each (a third of a
second of CPU, hundreds of them a run) is most of what it costs. Here each is the same
`gateway_sim` server, with its own ports, in this process's event loop. stdin takes one
command a line:

    start ID JSON     start a worker with the `gateway sim` flags in JSON (a list);
                      answers `READY ID PORT [name=PORT ...]` (the side servers, as the
                      `gateway sim` READY line has them) or `FAILED ID message`
    stop ID           stop that worker (as SIGTERM stops `gateway sim`)

and the process ends, stopping every worker, when stdin closes. A worker that must be a
process of its own (signals, SIGKILL, `x-sim-exit-after`, which ends this process) is
started with `gateway sim` instead (tests/conftest.py: the `sim_processes` mark).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Mapping

from gateway_sim.config import SimConfig
from gateway_sim.flags import add_sim_arguments
from gateway_sim.server import serve


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run(ident: str, flags: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="gateway sim", exit_on_error=False)
    add_sim_arguments(parser)

    def ready(port: int, side: Mapping[str, int]) -> None:
        say(" ".join([f"READY {ident} {port}", *(f"{name}={p}" for name, p in side.items())]))

    try:
        config = SimConfig.from_args(parser.parse_args(["--listen", "127.0.0.1:0", *flags]))
        await serve(config, ready=ready)
    except asyncio.CancelledError:
        raise
    except (Exception, SystemExit) as exc:  # a bad flag, a port in use: that worker's
        say(f"FAILED {ident} {exc!s}".replace("\n", " "))


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    workers: dict[str, asyncio.Task[None]] = {}
    while line := (await reader.readline()).decode():
        command, ident, *rest = line.rstrip("\n").split(" ", 2)
        if command == "start":
            workers[ident] = asyncio.create_task(run(ident, json.loads(rest[0])))
        elif command == "stop" and ident in workers:
            workers.pop(ident).cancel()
    for task in workers.values():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*workers.values(), return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main())
