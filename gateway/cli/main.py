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
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.app.run import own_signals, run_until_done, say
from gateway.config import (
    DESTINATION_HEADER,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    GatewayConfig,
    build_config,
    load_file,
    parse_processes,
    warn_renamed,
)
from gateway.config.addresses import host_port
from gateway.config.picker import MAX_BODY_BYTES
from gateway.core.policy_names import policy_names

if TYPE_CHECKING:
    from gateway.picker.envoy import PickerTls

__all__ = ["build_parser", "checked_config", "config_from_args", "main", "run_until_done", "say"]

WORKER_URL_HELP = """\
worker URL (--worker, a `workers:` entry, `gateway workers add`):
  grpc://HOST:PORT, or grpcs://HOST:PORT for TLS to the worker (see upstream_tls:), then
  query keys, each optional:
    model=NAME            the model it serves (default: asked from the worker)
    runtime=sglang|vllm   its engine's protocol (default: asked from the worker)
    role=regular|prefill|decode|encode
                          its part in disaggregated serving (default: asked from the
                          worker, else regular)
    bootstrap_port=N      a prefill's SGLang PD bootstrap port
    bootstrap_host=HOST   a prefill's bootstrap host (default: the URL's host)
    embedding_port=N      a prefill's port for encoder embeddings (EPD)
  e.g. grpc://10.0.0.5:30000?model=llama-3-8b&runtime=sglang
"""

ENVIRONMENT_HELP = """\
environment:
  GATEWAY_ADMIN_TOKEN   the admin token, unless --admin-token or --admin-token-file
                        gives one (it wins over admin.token in the file)
  GATEWAY_LOOP=uvloop   run on uvloop instead of asyncio's own event loop
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT
                        turn tracing on, exporting there over OTLP/gRPC
                        (tracing.endpoint wins)
  OTEL_SDK_DISABLED=true
                        tracing off, whatever is configured
  OTEL_SERVICE_NAME     the spans' service name (tracing.service_name wins; default
                        model-gateway)
  OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG
                        sampling, without tracing.sample_ratio (default: parent-based,
                        always on)
  OTEL_EXPORTER_OTLP_(TRACES_)INSECURE, _HEADERS, _CERTIFICATE, _TIMEOUT, _COMPRESSION
                        the OTLP exporter's other settings (read by the OpenTelemetry SDK)
  OTEL_RESOURCE_ATTRIBUTES
                        attributes added to every span's resource
  GRPC_VERBOSITY, GRPC_TRACE
                        grpc core's own logging (its lines are not throttled while
                        GRPC_TRACE is set)
  KUBECONFIG            kubernetes discovery's credentials outside a cluster, without
                        discovery[].kubeconfig (else ~/.kube/config)
"""

SERVE_EPILOG = WORKER_URL_HELP + "\n" + ENVIRONMENT_HELP

CHECK_CONFIG_DESCRIPTION = """\
Read and check a configuration exactly as `gateway serve` would (the same file, the same
flags, every check serve makes before it listens: the values, the addresses, the worker
URLs, the API keys file and the certificates read), without listening on any port or
starting anything; then print the effective configuration as YAML: every key, with its
value after the defaults and the flags (secrets such as admin.token shown as ***).
FILE is optional: without it (or --config), the flags and the defaults alone are
checked, as `gateway serve` without a file would run."""

CHECK_CONFIG_EPILOG = (
    """\
exit status:
  0  the configuration is valid: the effective configuration is on stdout (and on
     stderr, any warning serve would log, such as a renamed key)
  2  it is not: one line on stderr, the very line `gateway serve` would print
     (`gateway: config error: ...`), or a usage error

"""
    + ENVIRONMENT_HELP
)


def _add_serve_flags(
    p: argparse.ArgumentParser, files: argparse._ActionsContainer | None = None
) -> None:
    """The flags of `gateway serve`, which `gateway check-config` takes too (`files`: the
    group --config goes in, by default `p`)."""
    (files or p).add_argument(
        "--config", metavar="FILE", help="YAML config file (flags override it)"
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="main port (default 127.0.0.1:50051)")
    p.add_argument(
        "--worker", metavar="URL", action="append", default=[], help="a worker (repeatable)"
    )
    p.add_argument("--policy", choices=policy_names(), help="default policy (default round_robin)")
    p.add_argument(
        "--max-attempts", type=int, metavar="N", help="upstream attempts per request (default 3)"
    )
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
        "--picker-listen",
        metavar="HOST:PORT",
        help="also serve Envoy's external processing protocol here: the gateway as the "
        "endpoint picker of an Envoy that relays the calls itself (off by default)",
    )
    p.add_argument(
        "--picker-relay-address",
        metavar="IP:PORT",
        help="where the picker sends Envoy for the calls the relay runs (picker."
        "relay_address; default: the main port's listen address, a wildcard host as "
        "127.0.0.1)",
    )
    p.add_argument(
        "--picker-tls-cert",
        metavar="FILE",
        help="TLS on the picker port: certificate (PEM; default: the main port's --tls-cert)",
    )
    p.add_argument(
        "--picker-tls-key", metavar="FILE", help="TLS on the picker port: private key (PEM)"
    )
    p.add_argument(
        "--picker-tls-client-ca",
        metavar="FILE",
        help="require Envoy's client certificate, signed by this CA, on the picker port",
    )
    p.add_argument(
        "--picker-plaintext",
        action="store_const",
        const=True,
        help="serve the picker port without TLS past loopback: only where the network "
        "encrypts the hop itself (a service mesh's mTLS)",
    )
    p.add_argument(
        "--processes",
        metavar="N|auto",
        help="serving processes sharing the main port (default 1; auto: usable cores, "
        "within the container's CPU limit)",
    )
    p.add_argument("--log-format", choices=LOG_FORMATS, help="log format (console)")
    p.add_argument("--log-level", choices=LOG_LEVELS, help="log level (info)")


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway in front of a fleet of workers",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_flags(p)


def _add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check-config",
        help="check a configuration as serve would, print it, start nothing",
        description=CHECK_CONFIG_DESCRIPTION,
        epilog=CHECK_CONFIG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    files = p.add_mutually_exclusive_group()  # FILE or --config FILE, not both
    files.add_argument(
        "file", metavar="FILE", nargs="?", help="YAML config file (the same as --config FILE)"
    )
    _add_serve_flags(p, files)


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
            "picker.listen": args.picker_listen,
            "picker.relay_address": args.picker_relay_address,
            "picker.tls.cert": args.picker_tls_cert,
            "picker.tls.key": args.picker_tls_key,
            "picker.tls.client_ca": args.picker_tls_client_ca,
            "picker.plaintext": args.picker_plaintext,
            "processes": parse_processes(args.processes) if args.processes else None,
        },
    )


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
    _add_serve(sub)
    _add_check_config(sub)
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
    if config.processes > 1:
        from gateway.scale.supervisor import supervise

        return run_until_done(supervise(config))
    return run_until_done(serve(config))


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


ENVOY_CONFIG_DESCRIPTION = """\
Print, as YAML, the bootstrap of an Envoy that relays the calls itself with the gateway
as its endpoint picker (`gateway serve --picker-listen HOST:PORT`): one listener whose
calls pass Envoy's external processing filter (the picker places each one, or answers it
as the relay would), then go to the worker the picker named (an original destination
cluster that reads the address from the picker's header); Envoy health-checks the
picker. Run it with `envoy -c FILE`. It reads no gateway configuration: give the flags
that match it (--picker: where picker.listen is reached, --header: picker.header)."""

ENVOY_CONFIG_EPILOG = """\
--message-timeout-s bounds each answer of the picker, and a call waits in its model's
queue (flow control) before the picker answers its request: make it at least the longest
flow.classes[].ttl_s (the default, 330 s, covers the default batch class's 300 s), or
those calls fail at Envoy instead of waiting their turn.

exit status:
  0  the configuration is on stdout
  2  a usage error (a bad flag), told on stderr
"""

ENVOY_DEFAULTS = {
    "listen": "0.0.0.0:8080",
    "picker": "127.0.0.1:9002",
    "admin": "127.0.0.1:9901",
    "header": DESTINATION_HEADER,
    "message_timeout_s": 330.0,
    "max_body_bytes": MAX_BODY_BYTES,
}
METADATA_KEY = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")  # gRPC's, lowercase
# Envoy reads a duration; the picker's answer to a queued call may take this long.
MESSAGE_TIMEOUT_S = (0.001, 86_400.0)


def _host_port(text: str) -> str:
    """A HOST:PORT flag, checked as the gateway's own addresses are."""
    if host_port(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _admin_address(text: str) -> str | None:
    return None if text == "off" else _host_port(text)


def _header_name(text: str) -> str:
    """A header Envoy and gRPC both carry as it is: a gRPC metadata key."""
    name = text.lower()
    if not name or not set(name) <= METADATA_KEY:
        raise argparse.ArgumentTypeError(f"{text!r} is not a header name (a-z 0-9 - _ .)")
    return name


def _message_timeout(text: str) -> float:
    low, high = MESSAGE_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not low <= seconds <= high:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not seconds from {low:g} to {high:g}")
    return seconds


def _envoy_config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway envoy-config",
        description=ENVOY_CONFIG_DESCRIPTION,
        epilog=ENVOY_CONFIG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(**ENVOY_DEFAULTS)
    add = parser.add_argument
    add(
        "--listen",
        metavar="HOST:PORT",
        type=_host_port,
        help=f"where Envoy listens for clients (default {ENVOY_DEFAULTS['listen']})",
    )
    add(
        "--picker",
        metavar="HOST:PORT",
        type=_host_port,
        help="where Envoy reaches the gateway's picker port (gateway serve "
        f"--picker-listen; default {ENVOY_DEFAULTS['picker']})",
    )
    add(
        "--admin",
        metavar="HOST:PORT|off",
        type=_admin_address,
        help=f"Envoy's admin port, or none (default {ENVOY_DEFAULTS['admin']})",
    )
    add(
        "--header",
        metavar="NAME",
        type=_header_name,
        help=f"the header the picker names the worker in: picker.header (default "
        f"{DESTINATION_HEADER})",
    )
    add(
        "--message-timeout-s",
        metavar="S",
        type=_message_timeout,
        help="how long Envoy waits for each answer of the picker (default "
        f"{ENVOY_DEFAULTS['message_timeout_s']:g})",
    )
    add(
        "--max-body-bytes",
        metavar="N",
        type=_positive,
        help="the most of a request Envoy buffers for the picker: picker.max_body_bytes "
        f"(default {MAX_BODY_BYTES})",
    )
    add(
        "--picker-ca",
        metavar="FILE",
        help="the picker port serves TLS: the CA that signed its certificate (as Envoy "
        "reads the file)",
    )
    add(
        "--picker-sni",
        metavar="NAME",
        help="the name the picker's certificate is checked for (default: --picker's host)",
    )
    add("--picker-cert", metavar="FILE", help="Envoy's client certificate for the picker (mTLS)")
    add("--picker-key", metavar="FILE", help="its private key")
    return parser


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def envoy_config_yaml(
    listen: str,
    picker: str,
    admin: str | None,
    header: str,
    message_timeout_s: float,
    max_body_bytes: int = MAX_BODY_BYTES,
    picker_tls: PickerTls | None = None,
) -> str:
    """`gateway envoy-config`'s output: the bootstrap, under a comment with the command
    that made it (a copy kept in a repository then says how to make it again)."""
    import yaml

    from gateway.picker.envoy import envoy_config

    bootstrap = envoy_config(
        listen,
        picker,
        admin=admin,
        header=header,
        message_timeout_s=message_timeout_s,
        max_body_bytes=max_body_bytes,
        picker_tls=picker_tls,
    )
    tls = ""
    if picker_tls is not None:
        tls = f" \\\n#     --picker-ca {picker_tls.ca}"
        if picker_tls.cert is not None:
            tls += f" --picker-cert {picker_tls.cert} --picker-key {picker_tls.key}"
        if picker_tls.sni is not None:
            tls += f" --picker-sni {picker_tls.sni}"
    head = (
        "# Envoy with the gateway as its endpoint picker, made by\n"
        f"#   gateway envoy-config --listen {listen} --picker {picker} --admin {admin or 'off'}"
        f" \\\n#     --header {header} --message-timeout-s {message_timeout_s:g}"
        f" --max-body-bytes {max_body_bytes}{tls}\n"
        "# Run it with `envoy -c FILE`, the gateway with `gateway serve --picker-listen`.\n"
    )
    return head + yaml.safe_dump(bootstrap, sort_keys=False)


def _envoy_config(argv: Sequence[str]) -> int:
    parser = _envoy_config_parser()
    args = parser.parse_args(argv)
    from gateway.picker.envoy import PickerTls

    tls = None
    if args.picker_ca is not None:
        tls = PickerTls(args.picker_ca, args.picker_cert, args.picker_key, args.picker_sni)
    elif args.picker_cert or args.picker_key or args.picker_sni:
        parser.error("--picker-cert, --picker-key and --picker-sni need --picker-ca")
    if (args.picker_cert is None) != (args.picker_key is None):
        parser.error("--picker-cert and --picker-key go together")
    text = envoy_config_yaml(
        args.listen,
        args.picker,
        args.admin,
        args.header,
        args.message_timeout_s,
        args.max_body_bytes,
        tls,
    )
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "envoy-config": _envoy_config,
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
