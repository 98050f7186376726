"""`gateway serve | demo | sim`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.config import (
    POLICIES,
    ConfigError,
    GatewayConfig,
    build_config,
    load_file,
    parse_processes,
)

EPILOG = """\
worker URL: grpc://HOST:PORT?model=NAME&runtime=sglang|vllm&role=regular|prefill|decode|encode
            &bootstrap_port=N   (every query key optional: a missing model or runtime is
            asked from the worker)
"""


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway in front of a fleet of workers",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (flags override it)")
    p.add_argument("--listen", metavar="HOST:PORT", help="main port (default 127.0.0.1:50051)")
    p.add_argument(
        "--worker", metavar="URL", action="append", default=[], help="a worker (repeatable)"
    )
    p.add_argument("--policy", choices=POLICIES, help="default policy (default round_robin)")
    p.add_argument("--max-attempts", type=int, help="upstream attempts per request (default 3)")
    p.add_argument(
        "--probe-interval", type=float, metavar="S", help="worker probe interval (default 1 s)"
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        metavar="S",
        help="on SIGTERM, seconds to keep serving while NOT_SERVING (default 5)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="S",
        help="then, seconds in-flight calls get to finish (default 20)",
    )
    p.add_argument("--tls-cert", metavar="FILE", help="TLS on the main port: certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="TLS on the main port: private key (PEM)")
    p.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="require client certificates signed by this CA (mTLS)",
    )
    p.add_argument("--admin-listen", metavar="HOST:PORT", help="admin port (127.0.0.1:50052)")
    p.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="bearer token the admin port requires (visible in the process list: prefer "
        "--admin-token-file or GATEWAY_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--admin-token-file", metavar="FILE", help="read the admin bearer token from FILE"
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="Prometheus endpoint (127.0.0.1:9464; 'off' disables it)",
    )
    p.add_argument(
        "--processes",
        metavar="N|auto",
        help="serving processes sharing the main port (default 1; auto: usable cores, "
        "within the container's CPU limit)",
    )
    p.add_argument("--log-format", choices=("console", "json"), help="log format (console)")
    p.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="log level (info)"
    )


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin token: the flag, else the file, else GATEWAY_ADMIN_TOKEN."""
    if args.admin_token:
        return str(args.admin_token)
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"admin token file {args.admin_token_file!r}: {exc.strerror}"
            ) from None
        if not token:
            raise ConfigError(f"admin token file {args.admin_token_file!r} is empty")
        return token
    return os.environ.get("GATEWAY_ADMIN_TOKEN") or None


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    file_data = load_file(args.config) if args.config else None
    return build_config(
        file_data,
        worker_urls=args.worker,
        overrides={
            "listen": args.listen,
            "default_policy": args.policy,
            "max_attempts": args.max_attempts,
            "log_format": args.log_format,
            "log_level": args.log_level,
            "probe.interval_s": args.probe_interval,
            "drain.delay_s": args.drain_delay,
            "drain.grace_s": args.shutdown_grace,
            "admin.listen": args.admin_listen,
            "tls.cert": args.tls_cert,
            "tls.key": args.tls_key,
            "tls.client_ca": args.tls_client_ca,
            "admin.token": admin_token(args),
            "metrics.listen": args.metrics_listen,
            "processes": parse_processes(args.processes) if args.processes else None,
        },
    )


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("grpc-model-gateway")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    from gateway.admin.client import add_workers_arguments
    from gateway.demo import add_demo_arguments
    from gateway.sim import add_sim_arguments

    parser = argparse.ArgumentParser(
        prog="gateway", description="A gRPC-native model gateway for SGLang and vLLM workers."
    )
    parser.add_argument("--version", action="version", version=f"gateway {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    add_demo_arguments(sub.add_parser("demo", help="run a simulated fleet behind the gateway"))
    add_sim_arguments(sub.add_parser("sim", help="run one simulated SGLang or vLLM worker"))
    add_workers_arguments(
        sub.add_parser("workers", help="list, add, remove, drain or watch workers (admin API)")
    )
    return parser


def say(line: str) -> None:
    """One line on stderr, written at once: the serving processes of `--processes N`
    share it, and print() would write the newline apart."""
    sys.stderr.write(f"gateway: {line}\n")


def run_until_done(coro: object) -> int:
    """Run to the end; 2 with one line if a port cannot be bound, 130 on a Ctrl-C that
    arrived before the process took over its signals (never a traceback)."""
    from gateway.listen import CannotListen

    result: object = None
    try:
        if os.environ.get("GATEWAY_LOOP") == "uvloop":
            import uvloop

            result = uvloop.run(coro)  # type: ignore[arg-type]
        else:
            result = asyncio.run(coro)  # type: ignore[arg-type]
    except CannotListen as exc:
        say(str(exc))
        return 2
    except ConfigError as exc:  # found at start-up: an unreadable certificate or key file
        say(f"config error: {exc}")
        return 2
    except KeyboardInterrupt:
        return 130
    return result if isinstance(result, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from gateway.logs import configure
        from gateway.server import serve

        try:
            config = config_from_args(args)
        except ConfigError as exc:
            say(f"config error: {exc}")
            return 2
        if config.processes > 1:
            from gateway.scale.supervisor import supervise

            configure(config.log_format, config.log_level, process="supervisor")
            return run_until_done(supervise(config))
        configure(config.log_format, config.log_level)
        return run_until_done(serve(config))
    elif args.command == "workers":
        from gateway.admin.client import run_workers

        return run_workers(args)
    elif args.command == "demo":
        from gateway.demo import run_demo
        from gateway.launch import NotReady

        try:
            return run_until_done(run_demo(args))
        except NotReady as exc:  # every process it started is stopped by then
            say(f"demo: {exc}")
            return 1
    else:
        from gateway.sim import run_sim

        return run_until_done(run_sim(args))


if __name__ == "__main__":
    sys.exit(main())
