"""`gateway serve | check-config | envoy-config | demo | sim | workers | queues | models`:
the command line.

`gateway check-config` reads and checks a configuration exactly as `gateway serve` does
(`checked_config`, shared by both: the file, the flags, validation, and every file a
serving process reads at start-up), then prints it instead of serving.

`gateway serve`, `--version` and `--help` import what serving needs and nothing else: the
simulated workers and the demo (package `gateway_sim`, its own distribution
`grpc-model-gateway-sim`, in `sim/`) and the admin client are imported by their own
sub-commands, when they run. Entered through `gateway.__main__` (the `gateway` command,
`python -m gateway`), which makes SIGINT and SIGTERM quiet before this module (or
anything slow) is imported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gateway.app.run import own_signals, run_until_done, say
from gateway.cli.envoy_config import envoy_config
from gateway.cli.flags import add_check_config, add_serve, config_from_args
from gateway.config import (
    ConfigError,
    GatewayConfig,
    load_file,
    warn_renamed,
)

if TYPE_CHECKING:
    pass

__all__ = ["build_parser", "checked_config", "config_from_args", "main", "run_until_done", "say"]


def version() -> str:
    from gateway.core.version import installed_version

    return installed_version()


# The sub-commands whose modules are imported only when they run (each parses its own flags).
LAZY = {
    "demo": "run a simulated fleet behind the gateway (needs gateway_sim)",
    "sim": "run one simulated SGLang or vLLM worker (needs gateway_sim)",
    "workers": "list, add, remove, drain or watch workers (admin API)",
    "queues": "show the calls waiting for a worker, by model, class and tenant (admin API)",
    "models": "list the model aliases' splits, or change one (admin API)",
    "envoy-config": "print Envoy's configuration for the gateway as its endpoint picker",
}
NO_SIMULATOR = (
    "the simulator is not installed (package gateway_sim, distribution "
    "grpc-model-gateway-sim): pip install -e ./sim from the repository, or make run"
)


def build_parser() -> argparse.ArgumentParser:
    """`gateway` with `serve` and `check-config`; the other sub-commands are listed here
    but parsed by `main`, which hands their flags to their own modules."""
    parser = argparse.ArgumentParser(
        prog="gateway", description="A gRPC-native model gateway for SGLang and vLLM workers."
    )
    parser.add_argument("--version", action="version", version=f"gateway {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_check_config(sub)
    for name, text in LAZY.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def checked_config(
    args: argparse.Namespace, set_up_logs: Callable[[str, str, str | None], None]
) -> GatewayConfig | None:
    """What `serve` and `check-config` both run before anything listens: the file read,
    the flags applied, everything validated, the logs set up (`set_up_logs(format,
    level, process)`: grpc core's own lines are routed through them before the files
    below bring grpc up), and every file a serving process reads at start-up read once
    (API keys, certificates); then the renamed keys the file still uses are warned
    about. None once the first problem is told in one line (`config error: ...`, in the
    configured log format as soon as it is known)."""
    from gateway.app.assembly import preflight
    from gateway.observability.logs import prefer

    prefer(args.log_format or "console")  # a config error is a JSON line with the flag
    try:
        file_data = load_file(args.config) if args.config else None
        config = config_from_args(args, file_data)
        set_up_logs(config.log_format, config.log_level, _log_process(config))
        preflight(config)
    except ConfigError as exc:
        say(f"config error: {exc}")
        return None
    warn_renamed(file_data)
    return config


def _log_process(config: GatewayConfig) -> str | None:
    """The `process` field of every line: the supervisor's, with `--processes N`."""
    return "supervisor" if config.processes > 1 else None


def _serve(args: argparse.Namespace) -> int:
    from gateway.app.server import serve
    from gateway.observability.corelog import install

    config = checked_config(args, install)
    if config is None:
        return 2
    if args.watch_config and not args.config:
        say("config error: --watch-config needs --config FILE")
        return 2
    # SIGHUP (and --watch-config) read the file and the flags again, as here.
    reread = (lambda: config_from_args(args)) if args.config else None
    watch = args.config if args.watch_config else None
    if config.processes > 1:
        from gateway.scale.supervisor import supervise

        return run_until_done(supervise(config, reread, watch))
    return run_until_done(serve(config, reread=reread, watch=watch))


def _check_config(args: argparse.Namespace) -> int:
    """0 with the effective configuration on stdout, or 2 with serve's one line; the
    logs are set up as serve's, without routing grpc core's stderr (a thread)."""
    from gateway.cli.effective import effective_yaml
    from gateway.observability.logs import configure

    args.config = args.file or args.config
    config = checked_config(args, configure)
    if config is None:
        return 2
    sys.stdout.write(effective_yaml(config))
    sys.stdout.flush()
    return 0


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


def _admin(name: str, description: str) -> Callable[[Sequence[str]], int]:
    """An admin CLI command (`gateway workers|queues|models`): the admin client, imported
    only when the command runs, gives its arguments and runs it."""

    def command(argv: Sequence[str]) -> int:
        from gateway.admin.client import ADMIN_COMMANDS

        add_arguments, run = ADMIN_COMMANDS[name]
        parser = _parser(name, description)
        add_arguments(parser)
        args = parser.parse_args(argv)
        own_signals()
        return run(args)

    return command


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "envoy-config": envoy_config,
    "demo": _demo,
    "sim": _sim,
    "workers": _admin("workers", "List, add, remove, drain or watch workers (admin API)."),
    "queues": _admin(
        "queues", "Calls waiting for a worker (flow control), by model, class and tenant."
    ),
    "models": _admin("models", "Model aliases: list their splits, or change one (admin API)."),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:  # no option comes before a sub-command but -h/--version
        return COMMANDS[argv[0]](argv[1:])
    args = build_parser().parse_args(
        argv
    )  # --help, --version, serve, check-config, or a usage error
    return _check_config(args) if args.command == "check-config" else _serve(args)
