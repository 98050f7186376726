"""``gateway-sim`` and ``python -m gateway_sim``: the simulated worker on its own, same
flags as ``gateway sim``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from gateway_sim import add_sim_arguments, run_sim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gateway-sim",
        description="Simulated SGLang/vLLM gRPC worker (prints 'READY <port>' when listening).",
    )
    add_sim_arguments(parser)
    args = parser.parse_args(argv)
    # KeyboardInterrupt: a Ctrl-C before the signal handlers were installed.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_sim(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
