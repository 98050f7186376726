"""`gateway serve | demo | sim | workers | queues`: the command line.

`gateway serve`, `--version` and `--help` import what serving needs and nothing else: the
simulated workers and the demo (package `gateway_sim`, its own distribution
`grpc-model-gateway-sim`, in `sim/`) and the admin client are imported by their own
sub-commands, when they run. Entered through `gateway.__main__` (the `gateway` command,
`python -m gateway`), which makes SIGINT and SIGTERM quiet before this module (or
anything slow) is imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.app.run import own_signals, run_until_done, say
from gateway.config import (
    ConfigError,
    GatewayConfig,
    build_config,
    load_file,
    parse_processes,
    warn_renamed,
)
from gateway.core.policy_names import policy_names

__all__ = ["build_parser", "config_from_args", "main", "run_until_done", "say"]

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
    p.add_argument("--policy", choices=policy_names(), help="default policy (default round_robin)")
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


def config_from_args(
    args: argparse.Namespace, file_data: Mapping[str, Any] | None = None
) -> GatewayConfig:
    """`file_data`: the --config file already read (else it is read here)."""
    if file_data is None and args.config:
        file_data = load_file(args.config)
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


# The sub-commands whose modules are imported only when they run (each parses its own flags).
LAZY = {
    "demo": "run a simulated fleet behind the gateway (needs gateway_sim)",
    "sim": "run one simulated SGLang or vLLM worker (needs gateway_sim)",
    "workers": "list, add, remove, drain or watch workers (admin API)",
    "queues": "show the calls waiting for a worker, by model, class and tenant (admin API)",
}
NO_SIMULATOR = (
    "the simulator is not installed (package gateway_sim, distribution "
    "grpc-model-gateway-sim): pip install -e ./sim from the repository, or make run"
)


def build_parser() -> argparse.ArgumentParser:
    """`gateway` with `serve`; the other sub-commands are listed here but parsed by
    `main`, which hands their flags to their own modules."""
    parser = argparse.ArgumentParser(
        prog="gateway", description="A gRPC-native model gateway for SGLang and vLLM workers."
    )
    parser.add_argument("--version", action="version", version=f"gateway {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    for name, text in LAZY.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from gateway.app.server import serve
    from gateway.observability.corelog import install
    from gateway.observability.logs import prefer

    prefer(args.log_format or "console")  # a config error is a JSON line with the flag
    try:
        file_data = load_file(args.config) if args.config else None
        config = config_from_args(args, file_data)
    except ConfigError as exc:
        say(f"config error: {exc}")
        return 2
    if config.processes > 1:
        from gateway.scale.supervisor import supervise

        install(config.log_format, config.log_level, process="supervisor")
        warn_renamed(file_data)
        return run_until_done(supervise(config))
    install(config.log_format, config.log_level)
    warn_renamed(file_data)
    return run_until_done(serve(config))


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"gateway {command}", description=description)


def _has_simulator(command: str) -> bool:
    """Whether `gateway_sim` can be imported; if not, says so in one line."""
    try:
        import gateway_sim  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "gateway_sim":
            raise
        say(f"{command}: {NO_SIMULATOR}")
        return False
    return True


def _demo(argv: Sequence[str]) -> int:
    if not _has_simulator("demo"):
        return 2
    from gateway_sim.demo import add_demo_arguments, run_demo
    from gateway_sim.launch import NotReady

    parser = _parser("demo", "A simulated fleet behind the gateway, with grpcurl lines to paste.")
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_until_done(run_demo(args))
    except NotReady as exc:  # every process it started is stopped by then
        say(f"demo: {exc}")
        return 1


def _sim(argv: Sequence[str]) -> int:
    if not _has_simulator("sim"):
        return 2
    from gateway_sim import add_sim_arguments, run_sim

    parser = _parser(
        "sim", "Simulated SGLang/vLLM gRPC worker (prints 'READY <port>' when listening)."
    )
    add_sim_arguments(parser)
    return run_until_done(run_sim(parser.parse_args(argv)))


def _workers(argv: Sequence[str]) -> int:
    from gateway.admin.client import add_workers_arguments, run_workers

    parser = _parser("workers", "List, add, remove, drain or watch workers (admin API).")
    add_workers_arguments(parser)
    args = parser.parse_args(argv)
    own_signals()
    return run_workers(args)


def _queues(argv: Sequence[str]) -> int:
    from gateway.admin.client import add_queues_arguments, run_queues

    parser = _parser(
        "queues", "Calls waiting for a worker (flow control), by model, class and tenant."
    )
    add_queues_arguments(parser)
    args = parser.parse_args(argv)
    own_signals()
    return run_queues(args)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "demo": _demo,
    "sim": _sim,
    "workers": _workers,
    "queues": _queues,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:  # no option comes before a sub-command but -h/--version
        return COMMANDS[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)  # --help, --version, serve, or a usage error
    return _serve(args)
